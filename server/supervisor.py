"""One child process of a launcher: start it, wait until it is ready, stop it.

Every long-running program the launchers start (tritonserver, the nginx front door, the gRPC
door, the OpenAI gateway, redis-server, Prometheus) runs as a ``ChildProcess``: in its own
session (Ctrl-C reaches the launcher, which stops its children in order), tied to the launcher
(server/lifetime.py: it dies when the launcher dies, even by SIGKILL), its output in a log
file, a readiness poll with a timeout, and a stop that sends one signal, waits, then kills.

Each role (``TritonServer``, ``FrontDoor``, ``GatewayProcess``, ...) builds its command line,
chooses its probe and its stop signal, and turns ``NotReady`` into its own error message;
``Service`` gives each the same context manager: started and ready inside the ``with`` block,
stopped after it, also when it never became ready.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from server.lifetime import tied_command

log = logging.getLogger(__name__)

# Where a child's stdout and stderr go.
FILE = "file"  # appended to (or, log_mode "w", written over) log_path
PIPE = "pipe"  # read by a thread: written to log_path, kept as a tail in memory, echoed
DISCARD = "discard"  # /dev/null: the program writes its own log (nginx -e, redis --logfile)


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux; IANA's elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


# Ports this process has handed out: a port chosen for a child that has not bound it yet
# must not be chosen again for another (a cluster picks all its replicas' ports first).
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
_random = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing is bound to now, outside the kernel's ephemeral range, and not
    handed out before by this process.

    The kernel's own choice (``bind(port 0)``) comes from the ephemeral range, which outgoing
    connections also draw from: in the seconds between the choice and the child's bind, a
    connection could take the port and the child would fail to listen.
    """
    low, high = _ephemeral_range()
    # Above the usual fixed service ports (8000-8002, 8080, 9090, 6379, ...).
    candidates = (10000, low - 1) if low - 10000 >= 4096 else (high + 1, 65535)
    for _ in range(1000):
        port = _random.randint(*candidates)
        with _handed_out_lock:
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free TCP port on {host} in {candidates[0]}-{candidates[1]}")


def free_ports(count: int, taken: set[int], host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports not in ``taken``; they are added to ``taken``."""
    out: list[int] = []
    while len(out) < count:
        port = free_port(host)
        if port not in taken:
            taken.add(port)
            out.append(port)
    return out


def http_status(url: str, timeout: float = 2.0) -> int:
    """The HTTP status of a GET of ``url``; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


class NotReady(Exception):
    """``ChildProcess.wait_ready`` gave up: ``why`` is "exited" (``returncode`` says how),
    "stopped" (``should_stop`` answered True) or "timeout"."""

    def __init__(self, why: str, returncode: int | None = None):
        super().__init__(why if why != "exited" else f"exited with code {returncode}")
        self.why = why
        self.returncode = returncode


class ChildProcess:
    """One child process. ``start(command)``, ``wait_ready(probe, timeout)``, ``stop(grace)``;
    ``process`` is the ``subprocess.Popen`` of the last start (None before the first).

    ``tie``: the signal the child gets when this process dies (None: not tied). The kernel ties
    it to the *thread* that forked (server/lifetime.py): start it from a thread that lives as
    long as the child should. ``output``: FILE, PIPE or DISCARD (above); with PIPE the last
    ``tail_lines`` lines stay in memory for ``log_tail`` and each line is echoed to ``echo``.
    """

    def __init__(
        self,
        name: str,
        log_path: Path | None = None,
        *,
        output: str = FILE,
        log_mode: str = "a",
        tie: str | None = "SIGTERM",
        new_session: bool = True,
        stop_signal: int = signal.SIGTERM,
        grace: float = 10.0,
        echo: TextIO | None = None,
        tail_lines: int = 400,
    ):
        assert output in (FILE, PIPE, DISCARD) and log_mode in ("a", "w")
        assert output == DISCARD or log_path is not None, "a log file is needed to write the output to"
        self.name = name
        self.log_path = None if log_path is None else Path(log_path)
        self.output = output
        self.log_mode = log_mode
        self.tie = tie
        self.new_session = new_session
        self.stop_signal = stop_signal
        self.grace = grace
        self.echo = echo
        self.process: subprocess.Popen | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._reader: threading.Thread | None = None

    # --- start ----------------------------------------------------------------------------
    def start(
        self, command: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | str | None = None
    ) -> ChildProcess:
        """Start ``command`` (stdin /dev/null, output as ``output`` says)."""
        command, preexec = tied_command(list(command), self.tie) if self.tie else (list(command), None)
        popen: dict[str, Any] = dict(
            env=None if env is None else dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            start_new_session=self.new_session,
            preexec_fn=preexec,
        )
        if self.output == DISCARD:
            self.process = subprocess.Popen(list(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)
            return self
        log_path = self.log_path
        assert log_path is not None  # __init__ asserts it for every output but DISCARD
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.output == FILE:
            # The child holds its own descriptor: ours is closed at once.
            with log_path.open(self.log_mode + "b") as binary_log:
                self.process = subprocess.Popen(list(command), stdout=binary_log, stderr=subprocess.STDOUT, **popen)
            return self
        log_file = log_path.open(self.log_mode, encoding="utf-8")
        try:
            self.process = subprocess.Popen(
                list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", **popen
            )
        except BaseException:
            log_file.close()
            raise
        self._reader = threading.Thread(target=self._pump, args=(self.process, log_file), name=f"{self.name}-log", daemon=True)
        self._reader.start()
        return self

    def _pump(self, process: subprocess.Popen, log_file: TextIO) -> None:
        with log_file:
            assert process.stdout is not None
            for line in process.stdout:
                log_file.write(line)
                log_file.flush()
                self._tail.append(line)
                if self.echo is not None:
                    self.echo.write(line)
                    self.echo.flush()

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)

    # --- state ----------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tail(self) -> list[str]:
        """The lines kept in memory (PIPE output only), oldest first."""
        return list(self._tail)

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of its output: the tail in memory (PIPE) or the log file."""
        if self.output == PIPE:
            return "".join(list(self._tail)[-lines:])
        if self.log_path is None:
            return ""
        try:
            return "".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""

    # --- ready ----------------------------------------------------------------------------
    def wait_ready(
        self, probe: Callable[[], bool], timeout: float, *, should_stop: Callable[[], bool] = lambda: False, interval: float = 0.2
    ) -> None:
        """Poll ``probe`` every ``interval`` s until it answers True. Raises ``NotReady`` when
        ``should_stop`` answers True, when the child exits (checked before each probe) or after
        ``timeout`` s. ``probe`` may raise its own error (e.g. a companion process died)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if should_stop():
                raise NotReady("stopped")
            if not self.running():
                self._join_reader()  # the last lines of its output, for the message
                raise NotReady("exited", self.returncode)
            if probe():
                return
            time.sleep(interval)
        raise NotReady("timeout")

    # --- stop -----------------------------------------------------------------------------
    def send_signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:  # running()
            self.process.send_signal(sig)

    def kill(self, group: bool = False) -> None:
        """SIGKILL now (``group``: its whole process group) and reap it."""
        if self.process is None:
            return
        if group:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def stop(
        self,
        grace: float | None = None,
        sig: int | None = None,
        *,
        kill_group: bool = False,
        reap_group: bool = False,
        while_waiting: Callable[[], None] | None = None,
    ) -> int | None:
        """Send ``sig`` (default ``stop_signal``), wait ``grace`` s (default ``grace``) for the
        exit, then SIGKILL it (``kill_group``: its process group). ``reap_group``: SIGKILL the
        process group after the exit too, for children that would outlive it (tritonserver's
        stubs, nginx's workers). ``while_waiting`` is called every 0.1 s of the wait. Returns
        the exit code (None: never started)."""
        if self.process is None:
            return None
        grace = self.grace if grace is None else grace
        if self.process.poll() is None:
            self.process.send_signal(self.stop_signal if sig is None else sig)
            try:
                self._wait(grace, while_waiting)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", self.name, grace)
                self.kill(group=kill_group)
        if reap_group:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        self._join_reader()
        return self.process.returncode

    def _wait(self, timeout: float, while_waiting: Callable[[], None] | None) -> None:
        process = self.process
        assert process is not None  # stop() returns first when it was never started
        if while_waiting is None:
            process.wait(timeout=timeout)
            return
        deadline = time.monotonic() + timeout
        while process.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(process.args, timeout)
            while_waiting()
            time.sleep(0.1)

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Service:
    """The start / wait until ready / stop lifecycle as a context manager, written once:
    a role implements ``start()``, ``wait_ready()`` and ``stop()``."""

    def start(self):
        raise NotImplementedError

    def wait_ready(self) -> None:
        raise NotImplementedError

    def stop(self):
        raise NotImplementedError

    def __enter__(self):
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
