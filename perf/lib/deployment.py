"""The deployments the perf tools start, with the launcher's code (server/deployment.py), so no
tool constructs a TritonServer itself. ``start_deployment``: the whole system the whole-system
tools measure, tritonserver behind the nginx front door (Triton's response cache at the
launcher's default size), Redis as text_embedding_cached's L2 when asked for and installed, and
one OpenAI gateway. ``server_deployment``: tritonserver alone with the options a benchmark asks
for (models, precision variant, response cache, env, front door or not)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from server.deployment import Deployment, DeploymentOptions
from server.gateway import GatewayOptions
from server.process import DEFAULT_CACHE_SIZE_MB, free_port


def gateway_options(triton_grpc_url: str, workdir: Path, key: str, *extra_args: str) -> GatewayOptions:
    """An OpenAI gateway's options as the perf tools run it: a free port, API key ``key`` (its file beside
    ``workdir``), no rate limit, a 5 s drain (see start_deployment)."""
    return GatewayOptions(
        triton_grpc_url,
        port=free_port(),
        workdir=workdir,
        api_key_file=workdir.parent / "gateway-api-key",
        extra_args=["--rate-limit", "0", *extra_args],
        env={"GATEWAY_API_KEYS": key},
        drain_timeout=5,
    )


def start_gateways(gateways: Mapping[str, tuple[str, Sequence[str]]], workdir: Path, key: str, say, started: dict) -> None:
    """One OpenAI gateway per name (name -> tritonserver's gRPC host:port and extra arguments) into
    ``started`` (so that the caller stops what started), each of them ready."""
    from server.gateway import GatewayProcess

    for name, (url, extra) in gateways.items():
        started[name] = GatewayProcess(gateway_options(url, workdir / f"gateway-{name}", key, *extra)).start()
    for name, gateway in started.items():
        gateway.wait_ready(timeout=120)
        say(f"gateway {name} ready on {gateway.url}")


def start_deployment(models: Sequence[str], workdir: Path, key: str, use_redis: bool, say) -> Deployment:
    """tritonserver (front door on), Redis (optional) and one gateway, ready; stopped again if
    any part fails to start or to become ready."""
    # drain_timeout 5: tritonserver's own exit wait (--exit-timeout-secs) is 5 s, not the launcher's 30
    # (text_generation's unload has been seen to wait out the whole timeout after serving streams).
    options = DeploymentOptions.with_free_ports(
        workdir=workdir / "triton",
        models=tuple(models),
        cache_size_bytes=DEFAULT_CACHE_SIZE_MB << 20,
        drain_timeout=5,
        gateway=gateway_options("", workdir / "gateway", key),
        redis=use_redis,
    )
    deployment = Deployment(options)
    deployment.start()
    try:
        if deployment.redis is not None:
            say(f"redis on port {deployment.redis.port}")
        deployment.wait_ready(timeout=300, gateway_timeout=120)
        say(
            f"tritonserver ready ({', '.join(models)}): front door http {deployment.http_url}, grpc {deployment.grpc_url}; "
            f"gateway on {deployment.gateway.url if deployment.gateway else 'none'}"
        )
    except BaseException:
        deployment.stop()
        raise
    return deployment


def server_deployment(models: Sequence[str], workdir: Path, *, echo=None, **options) -> Deployment:
    """tritonserver alone (its doors on unless ``front_door=False``) on free ports, as a
    Deployment not yet started: ``options`` are DeploymentOptions' (cache_size_bytes,
    model_config_name, env, extra_args, front_door, ...). Call start()/wait_ready()/stop(), or use it as a
    context manager (started and ready inside, stopped after); ``deployment.triton`` is the
    tritonserver (its process, log_path, internal URLs)."""
    return Deployment(DeploymentOptions.with_free_ports(workdir=workdir, models=tuple(models), **options), echo=echo)
