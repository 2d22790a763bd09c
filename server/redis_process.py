"""A throw-away ``redis-server`` (Debian package ``redis-server``) for tests and benchmarks.

Free port on 127.0.0.1, no persistence (no RDB snapshots, no AOF), its own temporary
directory, a byte limit with LRU eviction like a cache deployment. ``kill()`` and
``restart()`` (same port) let tests take L2 away mid-run; ``pause()``/``resume()``
(SIGSTOP/SIGCONT) make it hang instead, as a slow or stuck Redis does.
"""

from __future__ import annotations

import shutil
import signal
import socket
import tempfile
from pathlib import Path

from server.supervisor import DISCARD, ChildProcess, NotReady, Service, free_port


class RedisError(RuntimeError):
    pass


class RedisProcess(Service):
    def __init__(self, port: int | None = None, maxmemory_mb: int = 256, tied: bool = False):
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(self.binary).exists():
            raise RedisError("redis-server not found: install the Debian package redis-server (scripts/setup.sh does)")
        self.port = port or free_port()
        self.maxmemory_mb = maxmemory_mb
        self.dir = Path(tempfile.mkdtemp(prefix="redis-"))
        # serve-cluster (``tied``): die with the launcher, even when it is SIGKILLed
        # (server/lifetime.py); the forking thread must then live as long as Redis should.
        # Redis writes its own log file; it stays in the caller's session.
        self.child = ChildProcess(
            "redis-server", self.dir / "redis.log", output=DISCARD, tie="SIGTERM" if tied else None, new_session=False
        )

    @property
    def tied(self) -> bool:
        return self.child.tie is not None

    @property
    def process(self):
        """redis-server's subprocess.Popen (None before start)."""
        return self.child.process

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisProcess:
        """Start it and wait until it answers PING."""
        self.child.start(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
                "--maxmemory",
                f"{self.maxmemory_mb}mb",
                "--maxmemory-policy",
                "allkeys-lru",
                "--logfile",
                str(self.dir / "redis.log"),
            ]
        )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        try:
            self.child.wait_ready(self.ping, timeout, interval=0.05)
        except NotReady as exc:
            if exc.why == "exited":
                raise RedisError(f"redis-server exited with {exc.returncode}: {self.log_tail()}") from None
            self.kill()
            raise RedisError(f"redis-server not answering on port {self.port} after {timeout:.0f} s") from None

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: gone at once, like a crashed Redis (data lost: nothing is persisted)."""
        if self.child.running():
            self.child.send_signal(signal.SIGCONT)  # a paused one too
            self.child.kill()

    def restart(self) -> RedisProcess:
        self.kill()
        return self.start()

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def log_tail(self, lines: int = 20) -> str:
        return self.child.log_tail(lines)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
