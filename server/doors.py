"""A deployment's doors (server/deployment.py starts them; docs/security.md says what they check).

- the front door: nginx on the public HTTP and metrics ports, checking every HTTP inference
  request (server/frontdoor.py);
- the gRPC door on the public gRPC port, checking every gRPC inference request, with its HTTP
  stream listener for generate_stream (server/grpc_door.py, server/stream_door.py);
- in front of a pool of replicas, the repository door: the repository API acts on every replica
  (server/repository_door.py).

One tritonserver (``make serve``): the doors talk to it straight, nginx to its HTTP and metrics
ports, the gRPC door to its gRPC port (one hop less: 0.78 -> 0.84 of direct throughput,
docs/security.md). A pool (serve-cluster): nginx balances the replicas through its upstream
lists, re-rendered and reloaded when one goes in or out, and the gRPC door forwards to nginx's
internal gRPC listener.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from server.frontdoor import DEFAULT_MAX_BODY_BYTES, FrontDoor, FrontDoorPorts, GatewayDoor, Upstream
from server.supervisor import free_ports, http_status

if TYPE_CHECKING:  # imported where they start: the door's own module imports grpc
    from server.deployment_parts import Backoff
    from server.grpc_door_process import GrpcDoor
    from server.repository_door import RepositoryDoor


class Doors:
    """The doors of one deployment on ``host``'s public ``ports`` (http, grpc, metrics).

    ``pool``: nginx balances the replicas (``upstreams`` at start and at each reload) and the
    repository door acts on all of them (``replica_addresses``); otherwise the doors talk to the
    one tritonserver ``upstreams[0]`` straight, whose stub watchdog marks models in
    ``health_dirs[0]``."""

    def __init__(
        self,
        host: str,
        ports: tuple[int, int, int],
        workdir: Path,
        repository: Path,
        *,
        pool: bool,
        health_dirs: Sequence[Path],
        starting_file: Path,
        repository_token: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        drain_timeout: float = 30.0,
    ):
        self.host = host
        self.http_port, self.grpc_port, self.metrics_port = ports
        self.workdir = workdir
        self.repository = repository
        self.pool = pool
        self.health_dirs = tuple(health_dirs)
        self.starting_file = starting_file  # exists while a listed replica is not ready (the gRPC door reads it)
        self.repository_token = repository_token
        self.max_body_bytes = max_body_bytes
        self.drain_timeout = drain_timeout
        self.front_door: FrontDoor | None = None
        self.grpc_door: GrpcDoor | None = None
        self.repository_door: RepositoryDoor | None = None
        self.reloads = 0
        # nginx's internal gRPC listener, the gRPC door's stream listener, and (pool) nginx's
        # internal listener for the stream door's own calls: loopback ports chosen at start.
        self.nginx_grpc_port = self.stream_door_port = self.stream_upstream_port = 0
        # The gRPC door's restarts: exits in a row, when the next may start, when the last started.
        self._grpc_door_exits = 0
        self._grpc_door_next_start = self._grpc_door_started = 0.0

    def ports(self, upstreams: Sequence[Upstream], gateway: GatewayDoor | None = None) -> FrontDoorPorts:
        """The front door's configuration for these replicas (and, in a pool, gateways)."""
        if not self.pool:
            one = upstreams[0]
            return FrontDoorPorts(
                self.host,
                self.http_port,
                self.nginx_grpc_port,
                self.metrics_port,
                one.host,
                one.http,
                one.grpc,
                one.metrics,
                grpc_listen_host="127.0.0.1",
                stream_door=f"127.0.0.1:{self.stream_door_port}",
            )
        ports = FrontDoorPorts.cluster(self.host, self.http_port, self.nginx_grpc_port, self.metrics_port, upstreams, gateway)
        ports.grpc_listen_host = "127.0.0.1"
        ports.repository_door_port = self.repository_door.port if self.repository_door is not None else None
        ports.stream_door = f"127.0.0.1:{self.stream_door_port}"
        ports.stream_upstream_listen = f"127.0.0.1:{self.stream_upstream_port}"
        return ports

    def start(
        self,
        taken: set[int],
        upstreams: Sequence[Upstream],
        gateway: GatewayDoor | None = None,
        replica_addresses: Callable[[], list] | None = None,
    ) -> Doors:
        """nginx (its configuration checked first: FrontDoorError), then the gRPC door; the
        repository door before them in a pool. Internal ports are chosen outside ``taken``."""
        self.nginx_grpc_port, self.stream_door_port, self.stream_upstream_port = free_ports(3, taken)
        if self.pool:
            from server.repository_door import RepositoryDoor

            assert replica_addresses is not None
            self.repository_door = RepositoryDoor(replica_addresses, self.repository_token).start()
        self.front_door = FrontDoor(
            self.ports(upstreams, gateway),
            self.workdir,
            self.repository,
            max_body_bytes=self.max_body_bytes,
            health_dir=None if self.pool else self.health_dirs[0],
            healing_dirs=self.health_dirs if self.pool else (),
        )
        self.front_door.check()
        self.front_door.start()
        from server.grpc_door_process import GrpcDoor

        if self.pool:
            upstream, health_dir, stream_upstream = f"127.0.0.1:{self.nginx_grpc_port}", None, self.stream_upstream_port
        else:
            upstream, health_dir, stream_upstream = (
                f"{upstreams[0].host}:{upstreams[0].grpc}",
                self.health_dirs[0],
                upstreams[0].http,
            )
        self.grpc_door = GrpcDoor(
            f"{self.host}:{self.grpc_port}",
            upstream,
            self.repository,
            self.front_door.workdir,
            health_dir,
            self.max_body_bytes,
            self.drain_timeout,
            starting_file=self.starting_file if self.pool else None,
            healing_dirs=self.health_dirs if self.pool else (),
            stream=(f"127.0.0.1:{self.stream_door_port}", f"127.0.0.1:{stream_upstream}"),
        ).start()
        return self

    def reload(self, upstreams: Sequence[Upstream], gateway: GatewayDoor | None = None) -> None:
        """Re-render nginx's configuration and reload it (FrontDoorError: the old one stays)."""
        assert self.front_door is not None
        self.front_door.ports = self.ports(upstreams, gateway)
        self.front_door.reload()
        self.reloads += 1

    def ready(self, public_host: str) -> bool:
        """The gRPC door listens, and, in front of one tritonserver, nginx answers its readiness
        on the public HTTP port (a pool's is whether its upstream list has the replicas in)."""
        if not self.pool and http_status(f"http://{public_host}:{self.http_port}/v2/health/ready") != 200:
            return False
        return self.grpc_door is None or self.grpc_door.ready()

    def failure(self) -> str | None:
        """nginx exited (with the end of its log), or None."""
        door = self.front_door
        if door is not None and not door.running():
            code = door.process.returncode if door.process is not None else None
            return f"the front door (nginx) exited unexpectedly (code {code})\n{door.log_tail()}"
        return None

    def grpc_door_exited(self) -> str | None:
        """The gRPC door's exit (code and the end of its log) when it is not running, else None."""
        door = self.grpc_door
        if door is None or door.process is None or door.process.poll() is None:
            return None
        return f"the gRPC door exited (code {door.process.returncode})\n{door.log_tail(10)}"

    def restart_grpc_door(self, now: float, backoff: Backoff) -> str | None:
        """Start a new gRPC door when the last one exited (it holds no state), after the
        backoff's wait for its exits in a row (one that served a minute starts the count
        again): what happened, or None."""
        exited = self.grpc_door_exited()
        if exited is None or self.grpc_door is None:
            if self.grpc_door is not None and now - self._grpc_door_started >= backoff.reset_after_s:
                self._grpc_door_exits = 0
            return None
        if now < self._grpc_door_next_start:
            return None
        self._grpc_door_exits += 1
        self._grpc_door_next_start = now + backoff.delay(self._grpc_door_exits)  # if this one exits too
        self._grpc_door_started = now
        self.grpc_door.start()
        return f"{exited}\nstarted a new one (exits in a row: {self._grpc_door_exits})"

    def stop(self, timeout: float | None = None) -> None:
        """The gRPC door and nginx, each draining its in-flight requests for ``timeout`` s at most
        (default drain_timeout), then the repository door."""
        timeout = self.drain_timeout if timeout is None else timeout
        if self.grpc_door is not None:
            self.grpc_door.stop(timeout=timeout)
        if self.front_door is not None:
            self.front_door.stop(timeout=timeout)
        if self.repository_door is not None:
            self.repository_door.stop()
