"""One deployment on one machine: 1..N tritonserver replicas (server/process.py) behind their
doors (server/doors.py), the OpenAI gateway(s), a Redis for text_embedding_cached's L2 and
Prometheus when asked for, and the supervision loop (server/deployment_loop.py) that watches
them all: it starts the replicas and the gateways, restarts a dead one with a bounded backoff
when the options say so, starts a new gRPC door when one exits, and keeps a pool's front door's
upstream list in step with who is ready.

``python -m server`` (make serve) runs one tritonserver, its doors talking to it straight;
``python -m server.cluster`` (make serve-cluster) runs a pool, nginx balancing the replicas
(server/cluster.py draws its topology); the integration tests' fixture and the perf harness
(perf/lib/deployment.py) start theirs here too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from server.deployment_loop import Supervision
from server.deployment_parts import READY, DeploymentOptions, Gateway, Replica
from server.doors import Doors
from server.frontdoor import DEFAULT_GATEWAY_MAX_BODY_BYTES, GatewayDoor, ports_in_use
from server.gateway import GatewayProcess
from server.process import Addresses, ServerError, ServerOptions, TritonServer
from server.prometheus import DEFAULT_PROMETHEUS_PORT, PROMETHEUS_TEMPLATE, RULES_DIR, Prometheus, render_prometheus, rule_files
from server.redis_process import RedisProcess
from server.supervisor import Service, free_ports, http_status

log = logging.getLogger(__name__)

REDIS_URL_ENV = "EMBEDDING_CACHE_L2_REDIS_URL"  # text_embedding_cached's L2 (python_backends/cache/settings.py)

__all__ = ["Deployment", "DeploymentError", "DeploymentOptions"]


class DeploymentError(ServerError):
    """The deployment did not come up, or was stopped before it did; ``log_tail`` says why."""


class Deployment(Addresses, Service):
    """Start, supervise and stop one deployment. Use as a context manager (start, then wait until
    every part is ready) or call start()/wait_ready()/failure()/stop(). Its http_url, grpc_url
    and metrics_url are where clients go: the doors (tritonserver's own without them).

    Call ``start()`` from a thread that lives as long as the deployment (the main thread): the
    doors, Redis and Prometheus die with the thread that started them. The replicas and the
    gateways are started, and restarted, by the supervision loop's thread, which lives until
    ``stop()``."""

    options: DeploymentOptions

    def __init__(self, options: DeploymentOptions, echo: TextIO | None = None, on_event: Callable[[str], None] | None = None):
        self.options = options
        self.echo = echo  # where the replicas' logs are echoed (None: only their log files)
        self.on_event = on_event or (lambda message: log.info("%s", message))
        self.workdir = Path(options.workdir).resolve()  # nginx -p and the replicas need it absolute
        self.redis: RedisProcess | None = None
        self.redis_url: str | None = options.redis_url
        self.prometheus: Prometheus | None = None
        self.rules: list[Path] = []
        self.doors: Doors | None = None
        # The replicas' stub watchdog folders, outside the work folder: nginx's workers (nobody
        # when the launcher is root) read them, and a test's work folder is 0700. Made at start.
        self.healing_root = Path(tempfile.gettempdir()) / f"deployment-health-{os.getpid()}-{secrets.token_hex(4)}"
        o = options
        self._taken = {o.http_port, o.grpc_port, o.metrics_port, *([o.gateway.port] if o.gateway else [])}
        self.replicas: list[Replica] = [Replica(i, self._replica_options(i)) for i in range(o.replicas)]
        self.gateways: list[Gateway] = []
        self._state_writer = threading.Lock()
        self.loop = Supervision(self)
        self._build_members()

    # --- layout ---------------------------------------------------------------------------
    def _replica_options(self, index: int) -> ServerOptions:
        """Its own ports (loopback behind the doors, a free one where not set) and folders."""
        o = self.options
        ports: list[int]
        if not o.front_door:
            host, ports, workdir = o.host, [o.http_port, o.grpc_port, o.metrics_port], o.workdir
        elif o.pool:
            host, ports, workdir = "127.0.0.1", free_ports(3, self._taken), self.workdir / f"replica-{index}"
        else:
            wanted = [o.triton_http_port, o.triton_grpc_port, o.triton_metrics_port]
            self._taken.update(p for p in wanted if p)
            chosen = iter(free_ports(wanted.count(0), self._taken))
            host, ports, workdir = "127.0.0.1", [p or next(chosen) for p in wanted], o.workdir
        return o.server_options(
            env={**o.env, REDIS_URL_ENV: o.redis_url} if o.redis_url else o.env,
            host=host,
            http_port=ports[0],
            grpc_port=ports[1],
            metrics_port=ports[2],
            workdir=workdir,
            # The one tritonserver behind its doors: its log named by the public port (its own is
            # a free one at each start), written over by the next start as without doors.
            log_name="" if o.pool else str(o.http_port),
            # Kept across its restarts: the doors resend a 500 / INTERNAL of a model marked
            # there (a dead stub being reloaded).
            health_dir=self.healing_root / f"replica-{index}",
            # Prometheus reads them: the class queue-time P99 alerts need the quantiles.
            summary_latencies=o.summary_latencies or o.prometheus_port is not None,
        )

    def _build_members(self) -> None:
        """Each replica's first TritonServer (its log_path known before start) and the gateways."""
        o = self.options
        for r in self.replicas:
            r.server, r.starts, r.state, r.in_door, r.error = TritonServer(r.options, echo=self.echo), 0, "down", False, None
            r.next_start, r.failures_in_row, r.exit_codes = 0.0, 0, []
        if o.gateway is None or (o.pool and o.gateways == 0):
            self.gateways = []
        elif not self.gateways:
            ports = free_ports(o.gateways, self._taken) if o.pool else [o.gateway.port]
            self.gateways = [Gateway(i, port) for i, port in enumerate(ports)]
        else:
            self.gateways = [Gateway(g.index, g.port) for g in self.gateways]

    @property
    def triton(self) -> TritonServer:
        """The first replica's tritonserver (the only one but in a pool)."""
        server = self.replicas[0].server
        assert server is not None  # _build_members gives each replica one
        return server

    @property
    def process(self):
        """The first replica's tritonserver subprocess.Popen (None before start)."""
        return self.triton.process

    @property
    def log_path(self) -> Path:
        return self.triton.log_path

    def log_tail(self, lines: int = 60) -> str:
        return self.triton.log_tail(lines)

    @property
    def triton_http_url(self) -> str:
        """The first replica's own HTTP address (internal behind the doors)."""
        return self.triton.http_url

    @property
    def triton_grpc_url(self) -> str:
        return self.triton.grpc_url

    @property
    def health_dir(self) -> Path:
        """The first replica's stub watchdog folder (server/stubs.py), kept across its restarts."""
        return self.triton.health_dir

    @property
    def front_door(self):
        return None if self.doors is None else self.doors.front_door

    @property
    def grpc_door(self):
        return None if self.doors is None else self.doors.grpc_door

    @property
    def gateway(self) -> GatewayProcess | None:
        """The first gateway's process (None: no gateway, or not started)."""
        return self.gateways[0].process if self.gateways else None

    @property
    def gateway_url(self) -> str | None:
        """The OpenAI gateways' public URL (a pool: the front door's gateway port; None: no gateway)."""
        if not self.gateways or self.options.gateway is None:
            return None
        host = self.options.reachable_host if self.options.pool else self.options.gateway.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{host}:{self.options.gateway.port}"

    @property
    def gateway_key_source(self) -> str:
        gateway = self.options.gateway
        if gateway is None:
            return ""
        merged = {**os.environ, **gateway.env}
        return "$GATEWAY_API_KEYS" if merged.get("GATEWAY_API_KEYS", "").strip() else str(gateway.api_key_file)

    @property
    def replica_starting_file(self) -> Path:
        """Exists while a replica listed in a pool's nginx is not ready (the gRPC door reads it)."""
        return self.workdir / "replica-starting"

    @property
    def state_path(self) -> Path:
        return self.workdir / "cluster.json"

    def gateway_options(self, gateway: Gateway):
        """What a gateway runs with: straight to the one tritonserver (and its stub watchdog's
        folder: a stream whose stub died is continued or ends with a 503), or, in a pool, through
        the front door's gRPC port like any client, sharing the rate limit's buckets in Redis."""
        o = self.options
        assert o.gateway is not None  # no gateway members without it
        if not o.pool:
            return dataclasses.replace(
                o.gateway,
                triton_grpc_url=self.triton_grpc_url,
                extra_args=["--triton-health-dir", str(self.health_dir), *o.gateway.extra_args],
            )
        return dataclasses.replace(
            o.gateway,
            port=gateway.port,
            triton_grpc_url=self.grpc_url,
            workdir=self.workdir,
            env={"GATEWAY_RATE_LIMIT_REDIS_URL": self.redis_url or "", **o.gateway.env},
        )

    def gateway_door(self) -> GatewayDoor | None:
        """A pool's OpenAI port on the front door, over its gateways (None: no gateway)."""
        o = self.options
        if not o.pool or not self.gateways or o.gateway is None:
            return None
        # The gateways' own body limit (GATEWAY_MAX_BODY_MB, as openai_gateway reads it).
        mb = {**os.environ, **o.gateway.env}.get("GATEWAY_MAX_BODY_MB", "").strip()
        limit = int(float(mb) * 1024 * 1024) if mb else DEFAULT_GATEWAY_MAX_BODY_BYTES
        return GatewayDoor(o.gateway.port, tuple(g.upstream() for g in self.gateways), limit)

    def replica_addresses(self) -> list:
        from server.repository_door import ReplicaAddress

        with self.loop.lock:
            return [
                ReplicaAddress(f"replica {r.index}", r.address, f"http://127.0.0.1:{r.metrics}/metrics", r.state)
                for r in self.replicas
            ]

    def describe(self) -> dict:
        """Where everything is (a pool writes it to ``cluster.json`` in its work folder)."""
        door = self.front_door
        with self.loop.lock:
            return {
                "front_door": {
                    "http": self.http_url,
                    "grpc": self.grpc_url,
                    "metrics": self.metrics_url,
                    "config": str(door.conf_path) if door else None,
                    "log": str(door.log_path) if door else None,
                    "reloads": self.doors.reloads if self.doors else 0,
                },
                "gateway": None if not self.gateways else {"url": self.gateway_url, "key": self.gateway_key_source},
                "gateways": [
                    {
                        "index": g.index,
                        "state": g.state,
                        "pid": g.pid,
                        "port": g.port,
                        "restarts": g.restarts,
                        "log": str(g.process.log_path if g.process else self.workdir / f"gateway-{g.port}.log"),
                        "exit_codes": list(g.exit_codes),
                    }
                    for g in self.gateways
                ],
                "prometheus": None
                if self.prometheus is None
                else {"url": self.prometheus.url, "config": str(self.prometheus.config_path)},
                "redis": self.redis_url,
                "redis_pid": None if self.redis is None or self.redis.process is None else self.redis.process.pid,
                "redis_restarts": self.loop.redis_restarts,
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

    def write_state(self) -> None:
        """cluster.json, from the loop's thread and the launcher's: one writer at a time (the
        supervision lock is held only while describe() reads the records)."""
        if not self.options.pool:
            return
        with self._state_writer:
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.describe(), indent=1), encoding="utf-8")
            tmp.replace(self.state_path)

    # --- start ----------------------------------------------------------------------------
    def start(self) -> Deployment:
        """Redis, the doors (every replica marked down in a pool: the public ports answer 502
        until one is ready) and Prometheus; the supervision loop starts the replicas and the
        gateways. A part that fails to start stops those started before it."""
        o = self.options
        if self.loop.started:  # started again: what is left stopped, fresh members on the same ports
            self.stop()
            self._build_members()
            self.loop = Supervision(self)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.healing_root.mkdir(mode=0o755, exist_ok=True)
        self.healing_root.chmod(0o755)  # whatever the umask
        self.replica_starting_file.unlink(missing_ok=True)  # a previous run's
        public = [o.http_port, o.grpc_port, o.metrics_port]
        busy = ports_in_use(o.host, public + ([o.gateway.port] if o.pool and o.gateway and self.gateways else []))
        if busy:
            raise DeploymentError(f"ports already in use on {o.host}: {', '.join(map(str, busy))} (another server running?)")
        try:
            if o.redis and shutil.which("redis-server"):
                self.redis = RedisProcess(tied=True).start()
                self.redis_url = self.redis.url
                for r in self.replicas:
                    r.options = dataclasses.replace(r.options, env={**r.options.env, REDIS_URL_ENV: self.redis_url})
                    assert r.server is not None
                    r.server.options = r.options
            if self.gateways and o.gateway is not None and not self.gateway_key_source.startswith("$"):
                from openai_gateway.auth import ensure_key_file

                ensure_key_file(o.gateway.api_key_file)  # once here: the gateways share it
            if o.front_door:
                self.doors = Doors(
                    o.host,
                    (o.http_port, o.grpc_port, o.metrics_port),
                    self.workdir,
                    o.model_repository,
                    pool=o.pool,
                    health_dirs=[r.options.health_dir for r in self.replicas if r.options.health_dir],
                    starting_file=self.replica_starting_file,
                    repository_token=o.repository_token,
                    max_body_bytes=o.max_body_bytes,
                    drain_timeout=o.drain_timeout,
                )
                self.loop.rendered = self.loop.wanted()
                self.doors.start(self._taken, [r.upstream() for r in self.replicas], self.gateway_door(), self.replica_addresses)
            self.loop.start()
            if o.prometheus_port is not None:
                port = o.prometheus_port or (
                    DEFAULT_PROMETHEUS_PORT
                    if not ports_in_use("127.0.0.1", [DEFAULT_PROMETHEUS_PORT])
                    else free_ports(1, self._taken)[0]
                )
                self.prometheus = Prometheus(self.workdir / "prometheus", port)
                self.rules = rule_files(RULES_DIR, self.loop.event)
                gateways = [g.address for g in self.gateways]
                self.prometheus.start(
                    render_prometheus(PROMETHEUS_TEMPLATE, self.replicas, gateways, self.rules, o.scrape_interval_s)
                )
        except BaseException:
            self.stop()
            raise
        self.write_state()
        return self

    def wait_ready(
        self, timeout: float | None = None, should_stop: Callable[[], bool] = lambda: False, gateway_timeout: float = 0.0
    ) -> None:
        """Until every replica and every model it loads is ready (and, in a pool, in the front
        door), the doors answer, then the gateways and Prometheus. A replica or gateway whose
        first start failed raises at once (a model that does not load is no crash to retry):
        a ServerError with the end of its log; so do a stop and the timeout (default the
        options' ready_timeout; ``gateway_timeout`` adds to it for the gateways)."""
        deadline = time.monotonic() + (self.options.ready_timeout if timeout is None else timeout)

        def check() -> None:
            if should_stop() or self.loop.stopping:
                raise DeploymentError("stopped before the deployment was ready")
            failure = self.doors.failure() if self.doors is not None else None
            if failure is None and self.doors is not None:  # a door that exits before ready does not start
                failure = self.doors.grpc_door_exited()
            if failure is not None:
                raise DeploymentError(failure.split("\n", 1)[0], failure)
            members: list[Replica | Gateway] = [*self.replicas, *self.gateways]
            for member in members:
                if member.error is not None:
                    message, _, tail = member.error.partition("\n")
                    child = member.server if isinstance(member, Replica) else member.process
                    raise ServerError(message, tail, child.log_path if child is not None else None)

        while True:
            check()
            with self.loop.lock:
                replicas = [r.state for r in self.replicas]
                in_door = self.loop.rendered is None or all(self.loop.rendered[: len(self.replicas)])
            if (
                all(s == READY for s in replicas)
                and in_door
                and (self.doors is None or self.doors.ready(self.options.reachable_host))
            ):
                break
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- replica {r.index} ({r.state}), {r.log_path} ---\n{r.server.log_tail(30) if r.server else ''}"
                    for r in self.replicas
                )
                pending = ", ".join(m for m in self.options.models if not self._model_ready(m)) or "none"
                raise DeploymentError(
                    f"not ready after {timeout or self.options.ready_timeout:.0f} s: replicas {replicas} "
                    f"(models not ready: {pending})",
                    tails,
                )
            time.sleep(0.2)
        deadline = max(deadline, time.monotonic() + 60.0) + gateway_timeout  # a gateway starts in seconds
        while not all(g.state == READY for g in self.gateways):
            check()
            if time.monotonic() > deadline:
                tails = "".join(
                    f"--- gateway {g.index} ({g.state}) ---\n{g.process.log_tail(30) if g.process else ''}\n"
                    for g in self.gateways
                    if g.state != READY
                )
                raise DeploymentError(f"gateways not ready in time: {[g.state for g in self.gateways]}", tails)
            time.sleep(0.2)
        if self.options.pool and self.gateways:
            # nginx applies a reload asynchronously (SIGHUP: new workers, the old ones finish):
            # ready means the front door's gateway port answers, not only that it was told to.
            url = f"{self.gateway_url}/health/ready"
            while http_status(url, timeout=2) != 200:
                check()
                if time.monotonic() > deadline:
                    raise DeploymentError(f"the front door's gateway port {url} did not answer 200 in time")
                time.sleep(0.1)
        if self.prometheus is not None:
            self.prometheus.wait_ready(timeout=30)

    def _model_ready(self, model: str) -> bool:
        return all(http_status(f"http://{r.address}/v2/models/{model}/ready") == 200 for r in self.replicas)

    def failure(self) -> str | None:
        """What exited unexpectedly and is not restarted (with the end of its log), or None while
        the deployment runs: nginx; with ``restart`` off, a replica or a gateway too."""
        if self.doors is not None and (failure := self.doors.failure()) is not None:
            return failure
        return self.loop.failure

    # --- stop -----------------------------------------------------------------------------
    def stop(self, logs_to: Path | None = None) -> int | None:
        """The gateways and the doors first (in-flight requests drain), then the replicas,
        Prometheus and Redis; the first replica's exit code is returned. With ``logs_to``, the
        first gateway's and replica's logs are copied there."""
        gateways = self.loop.stop_gateways()
        try:
            if self.doors is not None:
                self.doors.stop()
        finally:
            self.loop.stop()  # the loop's thread stops the replicas only once told to here
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.redis is not None:
            self.redis.stop()
        if logs_to is not None:
            if gateways and gateways[0].log_path.is_file():
                shutil.copyfile(gateways[0].log_path, logs_to / "gateway.log")
            if self.log_path.is_file():
                shutil.copyfile(self.log_path, logs_to / "tritonserver.log")
        shutil.rmtree(self.healing_root, ignore_errors=True)
        try:
            self.write_state()
        except OSError:
            pass
        process = self.triton.process
        return None if process is None else process.returncode
