"""One deployment on one machine: tritonserver with its doors (server/process.py), a Redis for
text_embedding_cached's L2 when asked for, and the OpenAI gateway; started in that order, watched
together, stopped in reverse. ``python -m server`` (make serve) runs one, and the whole-system
benchmarks start theirs through it (perf/lib/deployment.py). serve-cluster's ``Cluster``
(server/cluster.py) runs several tritonservers behind one front door with the same parts.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from server.gateway import GatewayOptions, GatewayProcess
from server.process import ServerOptions, TritonServer
from server.redis_process import RedisProcess
from server.supervisor import Service

REDIS_URL_ENV = "EMBEDDING_CACHE_L2_REDIS_URL"  # text_embedding_cached's L2 (python_backends/cache/settings.py)


@dataclass
class DeploymentOptions:
    """``server``: tritonserver and its doors. ``gateway``: the OpenAI gateway, or None for none;
    its ``triton_grpc_url`` is set to tritonserver's own gRPC port at start (it builds every
    request itself, so the doors have nothing to add). ``redis``: start a Redis of its own for
    the L2 (when ``redis-server`` is installed; the server's env may name another instead)."""

    server: ServerOptions
    gateway: GatewayOptions | None = None
    redis: bool = False


class Deployment(Service):
    """Start, watch and stop the parts of one deployment. Use as a context manager (start, then
    wait until every part is ready) or call start()/wait_ready()/failure()/stop()."""

    def __init__(self, options: DeploymentOptions, echo: TextIO | None = None):
        self.options = options
        self.triton = TritonServer(options.server, echo=echo)
        self.redis: RedisProcess | None = None
        self.gateway: GatewayProcess | None = None

    @property
    def http_url(self) -> str:
        return self.triton.http_url

    @property
    def grpc_url(self) -> str:
        return self.triton.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.triton.metrics_url

    def start(self, repository=None) -> Deployment:
        """Redis (if asked), tritonserver and its doors on ``repository`` (prepared by the
        caller, or here: server/repository_prep.py), then the gateway. A part that fails to
        start stops those started before it."""
        try:
            if self.options.redis and shutil.which("redis-server"):
                self.redis = RedisProcess().start()
                self.options.server.env = {**self.options.server.env, REDIS_URL_ENV: self.redis.url}
            self.triton.start(repository)
            if self.options.gateway is not None:
                gateway = dataclasses.replace(
                    self.options.gateway,
                    triton_grpc_url=self.triton.triton_grpc_url,
                    # the stub watchdog's folder: a stream whose stub died is continued or ends with a 503
                    extra_args=["--triton-health-dir", str(self.triton.health_dir), *self.options.gateway.extra_args],
                )
                self.gateway = GatewayProcess(gateway).start()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 240.0, should_stop=lambda: False, gateway_timeout: float = 60.0) -> None:
        """Until tritonserver and every model it loads are ready (ServerError otherwise), then the
        gateway (GatewayError)."""
        self.triton.wait_ready(timeout=timeout, should_stop=should_stop)
        if self.gateway is not None:
            self.gateway.wait_ready(timeout=gateway_timeout, should_stop=should_stop)

    def failure(self) -> str | None:
        """What exited unexpectedly (with the end of its log), or None while every part runs."""
        triton = self.triton
        if triton.process is not None and triton.process.poll() is not None:
            return f"tritonserver exited unexpectedly (code {triton.process.returncode})\n{triton.log_tail()}"
        if self.gateway is not None and not self.gateway.running():
            code = self.gateway.process.returncode if self.gateway.process is not None else None
            return f"the OpenAI gateway exited unexpectedly (code {code})\n{self.gateway.log_tail()}"
        door = triton.front_door
        if door is not None and not door.running():
            code = door.process.returncode if door.process is not None else None
            return f"the front door (nginx) exited unexpectedly (code {code})\n{door.log_tail()}"
        return None

    def stop(self, logs_to: Path | None = None) -> int | None:
        """The gateway, tritonserver (its exit code is returned), then Redis; with ``logs_to``,
        the gateway's and tritonserver's logs are copied there first."""
        if self.gateway is not None:
            self.gateway.stop()
            if logs_to is not None and self.gateway.log_path.is_file():
                shutil.copyfile(self.gateway.log_path, logs_to / "gateway.log")
        code = self.triton.stop()
        if logs_to is not None and self.triton.log_path.is_file():
            shutil.copyfile(self.triton.log_path, logs_to / "tritonserver.log")
        if self.redis is not None:
            self.redis.stop()
        return code
