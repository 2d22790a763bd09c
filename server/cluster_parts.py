"""What a serve-cluster is made of (server/cluster.py runs it): its options, the restart
backoff, and its members, the tritonserver replicas and the OpenAI gateways, with the states
the supervisor gives them and the upstream entry each is in the front door."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from server.frontdoor import DEFAULT_MAX_BODY_BYTES, GatewayServer, Upstream
from server.layout import ROOT
from server.process import ServerOptions, TritonServer

if TYPE_CHECKING:
    from server.gateway import GatewayProcess

# Replica states, as the supervisor sees them.
STARTING, READY, DOWN, STOPPED = "starting", "ready", "down", "stopped"


@dataclass(frozen=True)
class Backoff:
    """Restart delays: ``first_s``, doubling up to ``max_s``; back to ``first_s`` once a replica
    stayed ready ``reset_after_s``."""

    first_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def delay(self, failures: int) -> float:
        """The wait before restart number ``failures`` (1 = the first restart in a row)."""
        return min(self.max_s, self.first_s * 2 ** max(0, failures - 1))


@dataclass
class ClusterOptions:
    replicas: int = 2
    model_repository: Path = ROOT / "model_repository"
    workdir: Path = ROOT / ".triton" / "cluster"
    models: Sequence[str] = ()  # empty: the launcher's default models
    host: str = "127.0.0.1"  # the front door's (and so the cluster's) public address
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    model_config_name: str | None = None
    cache_size_bytes: int = 0
    # "": start a redis-server for the cluster; None: no shared L2; else that Redis.
    redis_url: str | None = ""
    gateway_port: int | None = 8080  # the front door's OpenAI port; None: no gateway
    gateways: int = 2  # gateway processes behind it (0: none)
    gateway_host: str = "127.0.0.1"  # where the gateways listen (internal ports)
    gateway_api_key_file: Path = ROOT / ".triton" / "gateway-api-key"
    gateway_env: Mapping[str, str] = field(default_factory=dict)
    prometheus_port: int | None = 0  # 0: 9090 when free, else a free port; None: no Prometheus
    scrape_interval_s: float = 5.0
    repository_token: str | None = None
    rollout_state: Path | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout: float = 30.0
    ready_timeout: float = 300.0
    backoff: Backoff = field(default_factory=Backoff)
    # Health checks of a ready replica: its /v2/health/ready every health_interval_s; this
    # many failures in a row mark it down in nginx (it is restarted only when it exits).
    health_interval_s: float = 1.0
    health_failures: int = 3
    env: Mapping[str, str] = field(default_factory=dict)
    echo: bool = False  # echo the replicas' logs on stdout


@dataclass
class Replica:
    index: int
    options: ServerOptions
    server: TritonServer | None = None
    state: str = DOWN
    in_door: bool = False  # listed in nginx: once ready, until it fails readiness while alive
    restarts: int = 0  # restarts done
    failures_in_row: int = 0
    next_start: float = 0.0
    ready_since: float = 0.0
    health_misses: int = 0
    waiter: threading.Thread | None = None
    exit_codes: list[int | None] = field(default_factory=list)

    @property
    def http(self) -> int:
        return self.options.http_port

    @property
    def grpc(self) -> int:
        return self.options.grpc_port

    @property
    def metrics(self) -> int:
        return self.options.metrics_port

    @property
    def workdir(self) -> Path:
        return self.options.workdir

    @property
    def pid(self) -> int | None:
        return None if self.server is None or self.server.process is None else self.server.process.pid

    @property
    def log_path(self) -> Path:
        return self.options.workdir / f"tritonserver-{self.options.http_port}.log"

    def alive(self) -> bool:
        return self.server is not None and self.server.process is not None and self.server.process.poll() is None

    def upstream(self) -> Upstream:
        # A replica that died stays listed: its ports refuse connections until its restarted
        # tritonserver has loaded its models (tritonserver opens them only then), and nginx sends
        # each refused request to the next replica. Taking it out and back would be two reloads,
        # and a reload closes the idle keep-alive connections of clients: a request written on
        # one at that instant is lost for a client that does not retry. Only a replica alive
        # but failing its readiness is taken out (in_door False).
        return Upstream("127.0.0.1", self.http, self.grpc, self.metrics, down=not self.in_door)


@dataclass
class Gateway:
    """One OpenAI gateway process behind the front door's gateway port."""

    index: int
    port: int
    process: GatewayProcess | None = None
    state: str = DOWN
    restarts: int = 0
    failures_in_row: int = 0
    next_start: float = 0.0
    ready_since: float = 0.0
    health_misses: int = 0
    exit_codes: list[int | None] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        proc = getattr(self.process, "process", None)
        return None if proc is None else proc.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process is not None and self.process.running()

    def upstream(self) -> GatewayServer:
        return GatewayServer("127.0.0.1", self.port, down=self.state != READY)
