"""The deployment the whole-system tools measure, started with the launcher's code: tritonserver behind
the nginx front door (Triton's response cache at the launcher's default size), Redis as
text_embedding_cached's L2 when asked for and installed, and one OpenAI gateway."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path


def start_deployment(models: Sequence[str], workdir: Path, key: str, use_redis: bool, say):
    """tritonserver (front door on), Redis (optional) and one gateway, as the launcher starts them."""
    from server.gateway import GatewayOptions, GatewayProcess
    from server.process import DEFAULT_CACHE_SIZE_MB, ServerOptions, TritonServer, free_port

    redis = None
    if use_redis and shutil.which("redis-server"):
        from server.redis_process import RedisProcess

        redis = RedisProcess().start()
        say(f"redis on port {redis.port}")
    env = {"EMBEDDING_CACHE_L2_REDIS_URL": redis.url} if redis else {}
    # drain_timeout 5: tritonserver's own exit wait (--exit-timeout-secs) is 5 s, not the launcher's 30
    # (text_generation's unload has been seen to wait out the whole timeout after serving streams).
    triton = TritonServer(
        ServerOptions.with_free_ports(
            workdir=workdir / "triton",
            models=tuple(models),
            cache_size_bytes=DEFAULT_CACHE_SIZE_MB << 20,
            env=env,
            drain_timeout=5,
        )
    )
    triton.start()
    gateway = None
    try:
        triton.wait_ready(timeout=300)
        say(f"tritonserver ready ({', '.join(models)}): front door http {triton.http_url}, grpc {triton.grpc_url}")
        gateway = GatewayProcess(
            GatewayOptions(
                triton.triton_grpc_url,
                port=free_port(),
                workdir=workdir / "gateway",
                api_key_file=workdir / "gateway-api-key",
                extra_args=["--rate-limit", "0"],
                env={"GATEWAY_API_KEYS": key},
                drain_timeout=5,
            )
        ).start()
        gateway.wait_ready(timeout=120)
        say(f"gateway ready on {gateway.url}")
    except BaseException:
        stop_deployment(triton, gateway, redis)
        raise
    return triton, gateway, redis


def stop_deployment(triton, gateway, redis, logs_to: Path | None = None) -> None:
    if gateway is not None:
        gateway.stop()
        if logs_to is not None and gateway.log_path.is_file():
            shutil.copyfile(gateway.log_path, logs_to / "gateway.log")
    if triton is not None:
        triton.stop()
        if logs_to is not None and triton.log_path.is_file():
            shutil.copyfile(triton.log_path, logs_to / "tritonserver.log")
    if redis is not None:
        redis.stop()
