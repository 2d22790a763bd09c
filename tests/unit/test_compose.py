"""docker-compose.yml and docker/Dockerfile agree with the repository.

No Docker engine runs on these machines, so nothing is built or started here: the checks
are that the paths compose mounts and builds from exist, that the models it loads are in
the mounted repository, and that the image's pins match the local ones.
"""

from __future__ import annotations

import re

import pytest

from server.layout import ROOT

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed; docker-compose.yml not checked")

COMPOSE = ROOT / "docker-compose.yml"
SERVICES = ("triton", "triton-cpu")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def flags(service: dict) -> dict[str, list[str]]:
    """tritonserver's --name=value flags of a service's command, by name (repeatable ones listed)."""
    command = service["command"]
    assert isinstance(command, list) and command[0] == "tritonserver", "command must be an exec-form list"
    found: dict[str, list[str]] = {}
    for arg in command[1:]:
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
    assert loaded == ["text_encoder", "text_embedding", "text_embedding_cached", "image_classification"]
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
    published = {p.rsplit(":", 1)[1] for p in service["ports"]}
    assert published == {"8000", "8001", "8002"}
    assert "/v2/health/ready" in " ".join(service["healthcheck"]["test"])


@pytest.mark.parametrize("name", SERVICES)
def test_result_cache_wiring(compose, name):
    service = compose["services"][name]
    args = flags(service)
    assert args["--cache-config"] == ["local,size=${TRITON_CACHE_SIZE_BYTES:-134217728}"]
    # the variant the cache keys on is the one --model-config-name selects
    assert service["environment"]["TRITON_MODEL_CONFIG_NAME"] == args["--model-config-name"][0]
    assert service["environment"]["EMBEDDING_CACHE_L2_REDIS_URL"].endswith("redis://redis:6379/0}")
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
