"""`python -m server.cluster` (``make serve-cluster REPLICAS=2``): several tritonserver replicas on one machine.

Topology (docs/cluster.md)::

    clients -> nginx front door (HTTP 8000, gRPC 8001, metrics 8002, OpenAI 8080)
                 -> replica 0 .. N-1: tritonserver on loopback, each its own ports and work folder
                 -> (8080) gateway 0 .. G-1: the OpenAI gateway on loopback ports
                               -> the front door's gRPC port
    redis-server: text_embedding_cached's shared L2, one for every replica
    Prometheus: scrapes every replica's metrics port (job "triton") and every gateway (job "gateway")

A supervisor thread starts the replicas and the gateways, restarts a dead one with a bounded
backoff (a gateway is back in the front door once its /health/ready answers 200), and keeps
the front door's upstream list in step: a replica alive but failing its readiness is marked
``down`` and nginx reloaded (SIGHUP), so traffic reaches it again only once its
``/v2/health/ready`` and every model's ready endpoint answer 200. A replica that died stays
listed, without a reload: its ports refuse connections until its restarted tritonserver has
loaded its models, and nginx's passive health checks and retries to the next upstream
(deploy/frontdoor/nginx.conf.template) carry the requests it is sent.

Every child is tied to this process (PR_SET_PDEATHSIG): Ctrl-C stops all of it in order, and a
killed launcher takes its children with it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from server.cluster_parts import DOWN, READY, STARTING, STOPPED, ClusterOptions, Gateway, Replica
from server.frontdoor import (
    DEFAULT_GATEWAY_MAX_BODY_BYTES,
    FrontDoor,
    FrontDoorError,
    FrontDoorPorts,
    GatewayDoor,
    ports_in_use,
)
from server.models import closure, with_dependencies
from server.process import ServerError, ServerOptions, TritonServer
from server.prometheus import (
    DEFAULT_PROMETHEUS_PORT,
    PROMETHEUS_TEMPLATE,
    RULES_DIR,
    Prometheus,
    render_prometheus,
    rule_files,
)
from server.repository_prep import prepare as prepare_repository
from server.supervisor import Service, free_ports, http_status

if TYPE_CHECKING:  # imported where they start: grpc, and the gateway's and Redis's modules, only when used
    from server.grpc_door_process import GrpcDoor
    from server.redis_process import RedisProcess
    from server.repository_door import RepositoryDoor

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    pass


class Cluster(Service):
    """N replicas, the front door over them, and their shared services.

    Call ``start()`` from a thread that lives as long as the cluster (the main thread): the
    front door, Redis, Prometheus and the gateway die with the thread that started them. The
    replicas are started, and restarted, by the supervisor thread, which lives until ``stop()``.
    """

    def __init__(self, options: ClusterOptions, on_event: Callable[[str], None] | None = None):
        if options.replicas < 1:
            raise ClusterError(f"replicas must be >= 1, not {options.replicas}")
        if options.gateways < 0:
            raise ClusterError(f"gateways must be >= 0, not {options.gateways}")
        self.options = options
        self.on_event = on_event or (lambda message: log.info("%s", message))
        self.workdir = Path(options.workdir).resolve()  # nginx -p and the replicas need it absolute
        self.replicas: list[Replica] = []
        self.front_door: FrontDoor | None = None
        self.grpc_door: GrpcDoor | None = None  # once started
        self.repository_door: RepositoryDoor | None = None  # once started
        self._states_written: tuple = ()
        self.nginx_grpc_port = 0
        self.stream_door_port = self.stream_upstream_port = 0
        self.redis: RedisProcess | None = None
        self.redis_url: str | None = None
        self.redis_restarts = 0
        self._redis_next_start = 0.0
        self.gateways: list[Gateway] = []
        self.prometheus: Prometheus | None = None
        self.rules: list[Path] = []
        self.reloads = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._rendered: tuple[bool, ...] | None = None
        self._probed: list[str] = self._served_models()  # what the health checks ask each replica
        # The replicas' stub watchdog folders, outside the work folder: nginx's workers (nobody
        # when the launcher is root) read them, and a test's work folder is 0700.
        import tempfile

        self.healing_root = Path(tempfile.mkdtemp(prefix="cluster-health-"))
        self.healing_root.chmod(0o755)

    # --- layout -------------------------------------------------------------------------
    def _replica_options(self, index: int, ports: Sequence[int]) -> ServerOptions:
        o = self.options
        env = dict(o.env)
        if self.redis_url:
            env["EMBEDDING_CACHE_L2_REDIS_URL"] = self.redis_url
        return ServerOptions(
            model_repository=o.model_repository,
            workdir=self.workdir / f"replica-{index}",
            models=tuple(o.models),
            host="127.0.0.1",
            http_port=ports[0],
            grpc_port=ports[1],
            metrics_port=ports[2],
            cache_size_bytes=o.cache_size_bytes,
            model_config_name=o.model_config_name,
            env=env,
            repository_token=o.repository_token,
            rollout_state=o.rollout_state,
            # The cluster's front door is in front of every replica; each replica on loopback.
            front_door=False,
            drain_timeout=o.drain_timeout,
            # Prometheus reads them here: the class queue-time P99 alerts need the quantiles.
            summary_latencies=True,
            # Its stub watchdog's folder, kept across restarts: the front door and the gRPC door
            # resend a 500 / INTERNAL of a model marked there (a dead stub being reloaded).
            health_dir=self.healing_root / f"replica-{index}",
        )

    @property
    def http_url(self) -> str:
        host = "127.0.0.1" if self.options.host in ("0.0.0.0", "") else self.options.host
        return f"{host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        host = "127.0.0.1" if self.options.host in ("0.0.0.0", "") else self.options.host
        return f"{host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.http_url.rsplit(':', 1)[0]}:{self.options.metrics_port}/metrics"

    @property
    def gateway_url(self) -> str | None:
        """The OpenAI gateways' public URL: the front door's gateway port (None: no gateway)."""
        if not self.gateways:
            return None
        host = "127.0.0.1" if self.options.host in ("0.0.0.0", "") else self.options.host
        return f"http://{host}:{self.options.gateway_port}"

    @property
    def gateway_key_source(self) -> str:
        merged = {**os.environ, **self.options.gateway_env}
        return "$GATEWAY_API_KEYS" if merged.get("GATEWAY_API_KEYS", "").strip() else str(self.options.gateway_api_key_file)

    def _gateway_log(self, gateway: Gateway) -> Path:
        return self.workdir / f"gateway-{gateway.port}.log"

    @property
    def healing_dirs(self) -> tuple[Path, ...]:
        return tuple(self.healing_root / f"replica-{i}" for i in range(self.options.replicas))

    @property
    def replica_starting_file(self) -> Path:
        """Exists while a replica listed in nginx is not ready (the gRPC door reads it)."""
        return self.workdir / "replica-starting"

    @property
    def state_path(self) -> Path:
        return self.workdir / "cluster.json"

    def describe(self) -> dict:
        """Where everything is (also written to ``cluster.json`` in the work folder)."""
        with self._lock:
            return {
                "front_door": {
                    "http": self.http_url,
                    "grpc": self.grpc_url,
                    "metrics": self.metrics_url,
                    "config": str(self.front_door.conf_path) if self.front_door else None,
                    "log": str(self.front_door.log_path) if self.front_door else None,
                    "reloads": self.reloads,
                },
                "gateway": None if not self.gateways else {"url": self.gateway_url, "key": self.gateway_key_source},
                "gateways": [
                    {
                        "index": g.index,
                        "state": g.state,
                        "pid": g.pid,
                        "port": g.port,
                        "restarts": g.restarts,
                        "log": str(self._gateway_log(g)),
                        "exit_codes": list(g.exit_codes),
                    }
                    for g in self.gateways
                ],
                "prometheus": None
                if self.prometheus is None
                else {"url": self.prometheus.url, "config": str(self.prometheus.config_path)},
                "redis": self.redis_url,
                "redis_pid": None if self.redis is None or self.redis.process is None else self.redis.process.pid,
                "redis_restarts": self.redis_restarts,
                "replicas": [
                    {
                        "index": r.index,
                        "state": r.state,
                        "pid": r.pid,
                        "http": r.http,
                        "grpc": r.grpc,
                        "metrics": r.metrics,
                        "restarts": r.restarts,
                        "log": str(r.log_path),
                        "exit_codes": list(r.exit_codes),
                    }
                    for r in self.replicas
                ],
            }

    def _write_state(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.describe(), indent=1), encoding="utf-8")
        tmp.replace(self.state_path)

    # --- start --------------------------------------------------------------------------
    def start(self) -> Cluster:
        o = self.options
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.replica_starting_file.unlink(missing_ok=True)  # a previous run's
        busy = ports_in_use(
            o.host, [o.http_port, o.grpc_port, o.metrics_port] + ([o.gateway_port] if o.gateway_port and o.gateways > 0 else [])
        )
        if busy:
            raise ClusterError(f"ports already in use on {o.host}: {', '.join(map(str, busy))} (another server running?)")
        if o.redis_url == "":
            from server.redis_process import RedisProcess

            self.redis = RedisProcess(tied=True).start()
            self.redis_url = self.redis.url
        else:
            self.redis_url = o.redis_url
        taken = {o.http_port, o.grpc_port, o.metrics_port, *([o.gateway_port] if o.gateway_port else [])}
        for index in range(o.replicas):
            self.replicas.append(Replica(index, self._replica_options(index, free_ports(3, taken))))
        if o.gateway_port and o.gateways > 0:
            self.gateways = [Gateway(i, port) for i, port in enumerate(free_ports(o.gateways, taken))]
            if not self.gateway_key_source.startswith("$"):
                from openai_gateway.auth import ensure_key_file

                ensure_key_file(o.gateway_api_key_file)  # once here: the gateways share it
        # nginx first, every replica marked down: the public ports answer 502 until one is ready.
        # The gRPC door holds the public gRPC port and checks every inference request
        # (server/grpc_door.py); nginx's gRPC listener behind it is internal.
        self.nginx_grpc_port = free_ports(1, taken)[0]
        # generate_stream: nginx -> the gRPC door's stream listener -> nginx's internal stream
        # listener, which balances the replicas (server/stream_door.py).
        self.stream_door_port, self.stream_upstream_port = free_ports(2, taken)
        # The repository API through the front door acts on every replica (server/repository_door.py).
        from server.repository_door import RepositoryDoor

        self.repository_door = RepositoryDoor(self._replica_addresses, o.repository_token).start()
        self.front_door = FrontDoor(
            self._door_ports(), self.workdir, o.model_repository, max_body_bytes=o.max_body_bytes, healing_dirs=self.healing_dirs
        )
        self.front_door.check()
        self._rendered = self._wanted()
        self.front_door.start()
        from server.grpc_door_process import GrpcDoor

        self.grpc_door = GrpcDoor(
            f"{o.host}:{o.grpc_port}",
            f"127.0.0.1:{self.nginx_grpc_port}",
            o.model_repository,
            self.front_door.workdir,
            None,
            o.max_body_bytes,
            o.drain_timeout,
            starting_file=self.replica_starting_file,
            healing_dirs=self.healing_dirs,
            stream=(f"127.0.0.1:{self.stream_door_port}", f"127.0.0.1:{self.stream_upstream_port}"),
        ).start()
        self._supervisor = threading.Thread(target=self._supervise, name="cluster-supervisor", daemon=True)
        self._supervisor.start()
        threading.Thread(target=self._health_checks, name="cluster-health", daemon=True).start()
        if o.prometheus_port is not None:
            port = o.prometheus_port or (
                DEFAULT_PROMETHEUS_PORT if not ports_in_use("127.0.0.1", [DEFAULT_PROMETHEUS_PORT]) else free_ports(1, taken)[0]
            )
            self.prometheus = Prometheus(self.workdir / "prometheus", port)
            self.rules = rule_files(RULES_DIR, self._event)
            self.prometheus.start(
                render_prometheus(
                    PROMETHEUS_TEMPLATE, self.replicas, [g.address for g in self.gateways], self.rules, o.scrape_interval_s
                )
            )
        self._write_state()
        return self

    def _gateway_max_body_bytes(self) -> int:
        """The gateways' own body limit (GATEWAY_MAX_BODY_MB, as openai_gateway reads it)."""
        mb = {**os.environ, **self.options.gateway_env}.get("GATEWAY_MAX_BODY_MB", "").strip()
        return int(float(mb) * 1024 * 1024) if mb else DEFAULT_GATEWAY_MAX_BODY_BYTES

    def _door_ports(self) -> FrontDoorPorts:
        o = self.options
        door = None
        if self.gateways:
            assert o.gateway_port is not None  # start() makes gateways only with a gateway port
            door = GatewayDoor(o.gateway_port, tuple(g.upstream() for g in self.gateways), self._gateway_max_body_bytes())
        ports = FrontDoorPorts.cluster(
            o.host, o.http_port, self.nginx_grpc_port, o.metrics_port, [r.upstream() for r in self.replicas], door
        )
        ports.grpc_listen_host = "127.0.0.1"
        ports.repository_door_port = self.repository_door.port if self.repository_door is not None else None
        ports.stream_door = f"127.0.0.1:{self.stream_door_port}"
        ports.stream_upstream_listen = f"127.0.0.1:{self.stream_upstream_port}"
        return ports

    def _replica_addresses(self) -> list:
        from server.repository_door import ReplicaAddress

        with self._lock:
            return [
                ReplicaAddress(f"replica {r.index}", f"127.0.0.1:{r.http}", f"http://127.0.0.1:{r.metrics}/metrics", r.state)
                for r in self.replicas
            ]

    def _wanted(self) -> tuple[bool, ...]:
        """Who is in the front door: the replicas, then the gateways."""
        return tuple(r.in_door for r in self.replicas) + tuple(g.state == READY for g in self.gateways)

    def wait_ready(self, timeout: float | None = None, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Until every replica is ready and in the front door, then the gateway and Prometheus."""
        deadline = time.monotonic() + (self.options.ready_timeout if timeout is None else timeout)
        while True:
            with self._lock:
                states = [r.state for r in self.replicas]
                gateways = [g.state for g in self.gateways]
                in_door = self._rendered is not None and all(self._rendered)
            if all(s == READY for s in states + gateways) and in_door and (self.grpc_door is None or self.grpc_door.ready()):
                break
            if self.grpc_door is not None and not self.grpc_door.running():
                raise ClusterError(f"the gRPC door exited:\n{self.grpc_door.log_tail()}")
            if should_stop() or self._stop.is_set():
                raise ClusterError("stopped before the cluster was ready")
            if self.front_door is not None and not self.front_door.running():
                raise ClusterError(f"the front door (nginx) exited:\n{self.front_door.log_tail()}")
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- replica {r.index} ({r.state}), {r.log_path} ---\n{r.server.log_tail(30) if r.server else ''}"
                    for r in self.replicas
                )
                tails += "".join(
                    f"\n--- gateway {g.index} ({g.state}), {self._gateway_log(g)} ---\n"
                    f"{g.process.log_tail(30) if g.process else ''}"
                    for g in self.gateways
                    if g.state != READY
                )
                raise ClusterError(f"not ready after the timeout: replicas {states}, gateways {gateways}\n{tails}")
            time.sleep(0.2)
        if self.gateways:
            # nginx applies a reload asynchronously (SIGHUP: new workers, the old ones finish):
            # ready means the front door's gateway port answers, not only that it was told to.
            url = f"{self.gateway_url}/health/ready"
            while http_status(url, timeout=2) != 200:
                if should_stop() or self._stop.is_set():
                    raise ClusterError("stopped before the cluster was ready")
                if time.monotonic() > deadline:
                    raise ClusterError(f"the front door's gateway port {url} did not answer 200 in time")
                time.sleep(0.1)
        if self.prometheus is not None:
            self.prometheus.wait_ready(timeout=30)

    # --- the supervisor -----------------------------------------------------------------
    def _event(self, message: str) -> None:
        try:
            self.on_event(message)
        except Exception:  # a printer must not stop the supervisor
            log.exception("cluster event printer failed")

    def _start_replica(self, replica: Replica) -> None:
        """From the supervisor thread (the replica is tied to it)."""
        o = self.options
        replica.server = TritonServer(replica.options, echo=sys.stdout if o.echo else None)
        replica.state = STARTING
        replica.health_misses = 0
        try:
            # Before each (re)start: the rollout state may have moved on since the last one.
            replica.server.start(prepare_repository(o.model_repository, o.models, o.rollout_state))
        except Exception as exc:  # noqa: BLE001 - a failed start is retried like a crash
            self._failed(replica, f"did not start: {exc}")
            return
        server = replica.server

        def wait() -> None:
            try:
                server.wait_ready(
                    timeout=o.ready_timeout, should_stop=lambda: self._stop.is_set() or server is not replica.server
                )
            except ServerError as exc:
                with self._lock:
                    if replica.server is server and not self._stop.is_set():
                        self._event(f"replica {replica.index}: not ready ({exc}); log {replica.log_path}")
                        replica.state = "failed-start"
                return
            with self._lock:
                if replica.server is server and replica.state == STARTING:
                    replica.state = READY
                    replica.in_door = True
                    replica.ready_since = time.monotonic()

        replica.waiter = threading.Thread(target=wait, name=f"replica-{replica.index}-ready", daemon=True)
        replica.waiter.start()

    def _failed(self, member: Replica | Gateway, why: str) -> None:
        """Mark a replica or a gateway down and schedule its restart with backoff."""
        backoff = self.options.backoff
        if member.ready_since and time.monotonic() - member.ready_since >= backoff.reset_after_s:
            member.failures_in_row = 0
        member.failures_in_row += 1
        delay = backoff.delay(member.failures_in_row)
        member.state = DOWN
        member.ready_since = 0.0
        member.next_start = time.monotonic() + delay
        kind = "replica" if isinstance(member, Replica) else "gateway"
        self._event(f"{kind} {member.index}: {why}; restart {member.restarts + 1} in {delay:.0f} s")

    def _start_gateway(self, gateway: Gateway) -> None:
        """From the supervisor thread (the gateway is tied to it, as the replicas are)."""
        from server.gateway import GatewayOptions, GatewayProcess

        o = self.options
        # Every gateway goes through the front door's gRPC port, so it fails over like any client.
        gateway.process = GatewayProcess(
            GatewayOptions(
                triton_grpc_url=self.grpc_url,
                host=o.gateway_host,
                port=gateway.port,
                model_repository=o.model_repository,
                api_key_file=o.gateway_api_key_file,
                workdir=self.workdir,
                drain_timeout=o.drain_timeout,
                # One rate limit per key for all gateways: the buckets live in the cluster's Redis.
                env={"GATEWAY_RATE_LIMIT_REDIS_URL": self.redis_url or "", **o.gateway_env},
            )
        )
        gateway.state = STARTING
        gateway.health_misses = 0
        try:
            gateway.process.start()
        except Exception as exc:  # noqa: BLE001 - a failed start is retried like a crash
            self._failed(gateway, f"did not start: {exc}")
            return
        self._watch_gateway(gateway)

    def _watch_gateway(self, gateway: Gateway) -> None:
        """Until its /health/ready answers 200 (it is up and sees Triton's models ready)."""
        process, deadline = gateway.process, time.monotonic() + self.options.ready_timeout
        assert process is not None  # _start_gateway has just started it

        def wait() -> None:
            while not self._stop.is_set() and gateway.process is process and gateway.state == STARTING:
                if process.status("/health/ready") == 200:
                    with self._lock:
                        if gateway.process is process and gateway.state == STARTING:
                            gateway.state = READY
                            gateway.health_misses = 0
                            gateway.ready_since = gateway.ready_since or time.monotonic()
                    return
                if time.monotonic() > deadline:
                    with self._lock:
                        if gateway.process is process and gateway.state == STARTING:
                            gateway.state = "failed-start"
                    return
                time.sleep(0.2)

        threading.Thread(target=wait, name=f"gateway-{gateway.index}-ready", daemon=True).start()

    def _tick_gateways(self, now: float) -> None:
        o = self.options
        for g in self.gateways:
            if g.state in (READY, STARTING) and g.process is not None and not g.alive():
                code = g.process.process.returncode if g.process.process else None
                g.exit_codes.append(code)
                pid = g.pid
                if pid is not None:
                    try:  # anything else in its process group
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                g.process.stop(timeout=0)  # closes its log
                self._failed(g, f"exited (code {code})")
            elif g.state == "failed-start":
                assert g.process is not None  # _watch_gateway sets failed-start on a started process
                g.process.stop(timeout=2)
                g.exit_codes.append(g.process.process.returncode if g.process.process else None)
                self._failed(g, f"/health/ready not 200 within {o.ready_timeout:.0f} s")
            elif g.state == READY and g.health_misses >= o.health_failures:
                self._event(
                    f"gateway {g.index}: /health failed {g.health_misses} times; out of the front door until it answers again"
                )
                g.state = STARTING
                self._watch_gateway(g)
        for g in self.gateways:
            if g.state == DOWN and now >= g.next_start and not self._stop.is_set():
                first = g.process is None
                if not first:
                    g.restarts += 1
                self._start_gateway(g)
                if not first:
                    self._event(f"gateway {g.index}: restarted (pid {g.pid}); back in the front door once ready")
                self._write_state()

    def _tick(self) -> None:
        now = time.monotonic()
        o = self.options
        with self._lock:
            for r in self.replicas:
                if r.state in (READY, STARTING) and r.server is not None and not r.alive():
                    code = r.server.process.returncode if r.server.process else None
                    r.exit_codes.append(code)
                    try:  # its python backend stubs and anything else in its process group
                        os.killpg(r.server.process.pid, signal.SIGKILL)
                    except (ProcessLookupError, AttributeError):
                        pass
                    self._failed(r, f"tritonserver exited (code {code})")
                elif r.state == "failed-start":
                    if r.server is not None:
                        r.server.stop(timeout=2)
                        r.exit_codes.append(r.server.process.returncode if r.server.process else None)
                    self._failed(r, "failed to become ready")
                elif r.state == READY and r.health_misses >= o.health_failures:
                    self._event(
                        f"replica {r.index}: a served model was not ready {r.health_misses} times in a row; "
                        "out of the front door until it answers again"
                    )
                    r.state = STARTING  # back in once ready again
                    r.in_door = False
                    self._watch_ready(r)
            for r in self.replicas:
                if r.state == DOWN and now >= r.next_start and not self._stop.is_set():
                    first = r.server is None
                    if not first:
                        r.restarts += 1
                    self._start_replica(r)
                    if not first:
                        self._event(f"replica {r.index}: restarted (pid {r.pid}); back in the front door once ready")
                    self._write_state()
            self._tick_gateways(now)
            self._tick_redis(now)
            self._sync_front_door()

    def _tick_redis(self, now: float) -> None:
        """The cluster's own redis-server (the replicas' L2 cache, the gateways' shared rate
        limit) is restarted on the same port when it exited; meanwhile the replicas serve from
        L1 and compute, and the rate limit fails open or closed as configured. Its contents are
        gone: a cache refills."""
        redis = self.redis
        if redis is None or redis.process is None or redis.process.poll() is None or self._stop.is_set():
            return
        if now < self._redis_next_start:
            return
        code = redis.process.returncode
        self.redis_restarts += 1
        try:
            redis.start()
        except Exception as exc:  # noqa: BLE001 - RedisError or OSError: tried again after a pause
            self._redis_next_start = now + 5.0
            self._event(f"redis: exited (code {code}); restart failed ({exc}); trying again in 5 s")
            return
        self._event(f"redis: exited (code {code}); restarted on port {redis.port} (pid {redis.process.pid})")
        self._write_state()

    def _watch_ready(self, replica: Replica) -> None:
        server = replica.server

        def wait() -> None:
            while not self._stop.is_set() and replica.server is server and replica.state == STARTING:
                if self._replica_healthy(replica):
                    with self._lock:
                        if replica.server is server and replica.state == STARTING:
                            replica.state = READY
                            replica.in_door = True
                            replica.health_misses = 0
                    return
                time.sleep(0.5)

        replica.waiter = threading.Thread(target=wait, name=f"replica-{replica.index}-health", daemon=True)
        replica.waiter.start()

    def _sync_front_door(self) -> None:
        """Re-render the upstream list and reload nginx when a replica went in or out (and
        write the state file when only the states changed: a restarted replica that is ready
        again needs no reload, it never left the list)."""
        wanted = self._wanted()
        states = tuple(r.state for r in self.replicas) + tuple(g.state for g in self.gateways)
        if states != self._states_written:
            self._states_written = states
            # The gRPC door resends NOT_FOUND while a listed replica is not ready (server/grpc_door.py).
            if any(r.in_door and r.state != READY for r in self.replicas):
                self.replica_starting_file.touch()
            else:
                self.replica_starting_file.unlink(missing_ok=True)
            if wanted == self._rendered:
                self._write_state()
        if wanted == self._rendered or self.front_door is None:
            return
        self.front_door.ports = self._door_ports()
        try:
            self.front_door.reload()
        except FrontDoorError as exc:
            self._event(f"front door: reload failed ({exc}); keeping the previous upstream list")
            return
        before = self._rendered or ()
        self._rendered = wanted
        self.reloads += 1
        for r, was, now in zip(self.replicas, before, wanted):
            if was != now:
                self._event(f"replica {r.index}: {'in' if now else 'out of'} the front door (127.0.0.1:{r.http}, pid {r.pid})")
        for g, was, now in zip(self.gateways, before[len(self.replicas) :], wanted[len(self.replicas) :]):
            if was != now:
                self._event(f"gateway {g.index}: {'in' if now else 'out of'} the front door ({g.address}, pid {g.pid})")
        self._write_state()

    def _served_models(self) -> list[str]:
        """What a replica must have ready to stay in the front door: the requested models and
        every model they reach (ensemble steps, BLS targets)."""
        repo = self.options.model_repository
        wanted = with_dependencies(repo, list(self.options.models))
        return sorted({m for model in wanted for m in closure(repo, model)} | set(wanted))

    def _replica_healthy(self, replica: Replica) -> bool:
        """Each served model ready (``/v2/models/<m>/ready``). Not ``/v2/health/ready``: under
        strict readiness tritonserver says not ready while any model loads, so every rollout
        step and repository load would take the replicas out of the front door while the old
        models still serve."""
        if not self._probed:
            return http_status(f"http://127.0.0.1:{replica.http}/v2/health/ready", timeout=2) == 200
        return all(http_status(f"http://127.0.0.1:{replica.http}/v2/models/{m}/ready", timeout=2) == 200 for m in self._probed)

    def _health_checks(self) -> None:
        """Its own thread: a hung replica's 2-s timeouts must not delay the supervisor's tick."""
        o = self.options
        while not self._stop.wait(o.health_interval_s):
            with self._lock:
                due = [(r, r.server) for r in self.replicas if r.state == READY]
                gateways = [(g, g.process) for g in self.gateways if g.state == READY and g.process is not None]
            for r, server in due:
                ok = self._replica_healthy(r)
                with self._lock:
                    if r.server is server and r.state == READY:
                        r.health_misses = 0 if ok else r.health_misses + 1
            # A gateway's liveness only (/health): its readiness follows Triton's, and a replica
            # restart must not take every gateway out.
            for g, process in gateways:
                ok = process.status("/health") == 200
                with self._lock:
                    if g.process is process and g.state == READY:
                        g.health_misses = 0 if ok else g.health_misses + 1

    def _supervise(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:  # the supervisor must outlive any one mistake
                log.exception("cluster supervisor tick failed")
            self._stop.wait(0.2)
        # The replicas are tied to this thread: stop them here, side by side, before it ends.
        stoppers = [threading.Thread(target=self._stop_replica, args=(r,), daemon=True) for r in self.replicas]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()

    def _stop_replica(self, replica: Replica) -> None:
        if replica.server is not None:
            try:
                replica.server.stop()
            except Exception:
                log.exception("replica %d did not stop cleanly", replica.index)
        replica.state = STOPPED

    # --- stop ---------------------------------------------------------------------------
    def stop(self) -> None:
        """The gateway and the front door first (in-flight requests drain), then the replicas,
        Prometheus and Redis."""
        self._stop.set()
        with self._lock:  # after this, the supervisor starts no gateway (it checks _stop under the lock)
            gateways = [(g, g.process) for g in self.gateways if g.process is not None]
        stoppers = [threading.Thread(target=process.stop, daemon=True) for _, process in gateways]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        for g, _ in gateways:
            g.state = STOPPED
        if self.grpc_door is not None:
            self.grpc_door.stop(timeout=self.options.drain_timeout)
        if self.front_door is not None:
            self.front_door.stop(timeout=self.options.drain_timeout)
        if self.repository_door is not None:
            self.repository_door.stop()
        if self._supervisor is not None:
            self._supervisor.join()
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.healing_root, ignore_errors=True)
        try:
            self._write_state()
        except OSError:
            pass


if __name__ == "__main__":  # python -m server.cluster (make serve-cluster): the command line is server/cluster_cli.py
    from server.cluster_cli import main

    sys.exit(main())
