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
import subprocess
import tempfile
import time
from pathlib import Path

from server.lifetime import tie_to_parent
from server.process import free_port


class RedisError(RuntimeError):
    pass


class RedisProcess:
    def __init__(self, port: int | None = None, maxmemory_mb: int = 256, tied: bool = False):
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(self.binary).exists():
            raise RedisError("redis-server not found: install the Debian package redis-server (scripts/setup.sh does)")
        self.port = port or free_port()
        self.maxmemory_mb = maxmemory_mb
        # serve-cluster: die with the launcher, even when it is SIGKILLed (server/lifetime.py); the
        # forking thread must then live as long as Redis should.
        self.tied = tied
        self.dir = Path(tempfile.mkdtemp(prefix="redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisProcess":
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes",
             "--maxmemory", f"{self.maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru",
             "--logfile", str(self.dir / "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=tie_to_parent("SIGTERM") if self.tied else None,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RedisError(f"redis-server exited with {self.process.returncode}: {self.log_tail()}")
            if self.ping():
                return self
            time.sleep(0.05)
        self.kill()
        raise RedisError(f"redis-server not answering on port {self.port} after {timeout:.0f} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: gone at once, like a crashed Redis (data lost: nothing is persisted)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()

    def restart(self) -> "RedisProcess":
        self.kill()
        return self.start()

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def log_tail(self, lines: int = 20) -> str:
        log = self.dir / "redis.log"
        return "".join(log.read_text(errors="replace").splitlines(True)[-lines:]) if log.is_file() else ""

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
