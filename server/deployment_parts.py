"""What a deployment is made of (server/deployment.py runs it): its options, the restart
backoff, and its members, the tritonserver replicas and the OpenAI gateways, with the states
the supervision loop gives them and the upstream entry each is in a pool's front door."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from pathlib import Path

from server.frontdoor import DEFAULT_MAX_BODY_BYTES, GatewayServer, Upstream
from server.gateway import GatewayOptions, GatewayProcess
from server.process import ServerOptions, TritonServer

# Members' states, as the supervision loop sees them.
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
class DeploymentOptions(ServerOptions):
    """One deployment: ``replicas`` tritonservers, each with the tritonserver options inherited
    here (``host`` and the ports are the deployment's public ones), and its parts."""

    replicas: int = 1
    # serve-cluster: nginx balances the replicas (any number of them) through its upstream lists,
    # with the repository door and the gateways behind it. Off: one tritonserver, the doors
    # talking to it straight (make serve).
    pool: bool = False
    # The doors (server/doors.py) on the public ports; the one tritonserver of a deployment
    # that is no pool then listens on 127.0.0.1 at the triton_* ports (0: a free port). Off:
    # tritonserver itself on the public ports, undefended.
    front_door: bool = True
    triton_http_port: int = 0
    triton_grpc_port: int = 0
    triton_metrics_port: int = 0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # The OpenAI gateway(s): ``port`` is the public one, ``triton_grpc_url`` is set at start.
    # One gateway straight on it; in a pool, ``gateways`` of them on loopback behind the front
    # door's gateway port (0: none).
    gateway: GatewayOptions | None = None
    gateways: int = 1
    # A redis-server of the deployment's own (when installed), or an existing one at redis_url:
    # text_embedding_cached's L2 for every replica, and the pool's gateways' shared rate limit.
    redis: bool = False
    redis_url: str | None = None
    prometheus_port: int | None = None  # 0: 9090 when free, else a free port; None: no Prometheus
    scrape_interval_s: float = 5.0
    # Restart a replica or a gateway that died, with backoff (the launchers). Off: a dead one is
    # the deployment's failure() (the tests and the benchmarks, which kill parts on purpose).
    restart: bool = False
    backoff: Backoff = field(default_factory=Backoff)
    ready_timeout: float = 300.0
    # Health checks of ready members: each served model of a pooled replica, each gateway's
    # /health, every health_interval_s; this many failures in a row take it out of the front
    # door until it answers again (it is restarted only when it exits).
    health_interval_s: float = 1.0
    health_failures: int = 3

    def __post_init__(self):
        super().__post_init__()
        if self.replicas < 1 or (self.replicas > 1 and not self.pool):
            raise ValueError(f"replicas must be >= 1 (several only in a pool), not {self.replicas}")
        if self.gateways < 0:
            raise ValueError(f"gateways must be >= 0, not {self.gateways}")
        if self.pool and not self.front_door:
            raise ValueError("a pool needs its front door")

    def server_options(self, **changes) -> ServerOptions:
        """Every replica's tritonserver options: these, with ``changes``."""
        mine = {f.name: getattr(self, f.name) for f in fields(ServerOptions)}
        return ServerOptions(**{**mine, **changes})


@dataclass
class Replica:
    index: int
    options: ServerOptions
    server: TritonServer | None = None  # the last start's (a new one at each start)
    starts: int = 0
    state: str = DOWN
    in_door: bool = False  # listed in nginx: once ready, until it fails readiness while alive
    restarts: int = 0  # restarts done
    failures_in_row: int = 0
    next_start: float = 0.0
    ready_since: float = 0.0
    health_misses: int = 0
    waiter: threading.Thread | None = None
    exit_codes: list[int | None] = field(default_factory=list)
    error: str | None = None  # why its first start failed, with the end of its log

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
        return self.options.log_path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http}"

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
    options: GatewayOptions | None = None
    process: GatewayProcess | None = None  # the last start's
    starts: int = 0
    state: str = DOWN
    restarts: int = 0
    failures_in_row: int = 0
    next_start: float = 0.0
    ready_since: float = 0.0
    health_misses: int = 0
    exit_codes: list[int | None] = field(default_factory=list)
    error: str | None = None  # why its first start failed, with the end of its log

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
