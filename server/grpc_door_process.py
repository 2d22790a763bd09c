"""The gRPC door (server/grpc_door.py) as a child process of the launcher or serve-cluster:
its command line, start, wait until it listens, and stop with its drain. Kept apart from the
door itself so that starting it does not import grpc into the launcher."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from server.supervisor import ChildProcess, NotReady


class GrpcDoor:
    """The door as a child process of the launcher (dies with it: PR_SET_PDEATHSIG)."""

    def __init__(
        self,
        listen: str,
        upstream: str,
        repository: Path,
        workdir: Path,
        health_dir: Path | None,
        max_message_bytes: int,
        drain_timeout: float = 30.0,
        starting_file: Path | None = None,
        healing_dirs: tuple[Path, ...] = (),
        stream: tuple[str, str] | None = None,
    ):
        # (listen, upstream) of the HTTP stream door (server/stream_door.py); None: none.
        self.stream = stream
        self.drain_timeout = drain_timeout
        self.starting_file = starting_file
        self.healing_dirs = tuple(healing_dirs)
        self.listen = listen
        self.upstream = upstream
        self.repository = repository
        self.workdir = Path(workdir)
        self.health_dir = health_dir
        self.max_message_bytes = max_message_bytes
        # A restart appends to the log: the last one's lines stay.
        self.child = ChildProcess("the gRPC door", self.log_path, tie="SIGTERM")

    @property
    def process(self):
        """The door's subprocess.Popen (None before start)."""
        return self.child.process

    @property
    def log_path(self) -> Path:
        return self.workdir / "grpc-door.log"

    @property
    def ready_file(self) -> Path:
        return self.workdir / "grpc-door.ready"

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "server.grpc_door",
            "--listen",
            self.listen,
            "--upstream",
            self.upstream,
            "--repository",
            str(self.repository),
            "--max-message-mb",
            str(max(1, self.max_message_bytes >> 20)),
            "--ready-file",
            str(self.ready_file),
            "--drain-timeout",
            str(self.drain_timeout),
        ]
        if self.health_dir is not None:
            cmd += ["--health-dir", str(self.health_dir)]
        if self.starting_file is not None:
            cmd += ["--replica-starting-file", str(self.starting_file)]
        for folder in self.healing_dirs:
            cmd += ["--healing-dir", str(folder)]
        if self.stream is not None:
            cmd += ["--stream-listen", self.stream[0], "--stream-upstream", self.stream[1]]
        return cmd

    def start(self) -> GrpcDoor:
        from server.layout import ROOT

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        self.child.start(self.command(), env=env)
        return self

    def ready(self) -> bool:
        return self.running() and self.ready_file.is_file()

    def wait_listening(self, timeout: float = 30.0) -> None:
        try:
            self.child.wait_ready(self.ready_file.is_file, timeout, interval=0.05)
        except NotReady as exc:
            if exc.why == "exited":
                raise RuntimeError(f"the gRPC door exited with code {exc.returncode}:\n{self.log_tail()}") from None
            raise RuntimeError(f"the gRPC door did not listen within {timeout:.0f} s:\n{self.log_tail()}") from None

    def running(self) -> bool:
        return self.child.running()

    def log_tail(self, lines: int = 20) -> str:
        return self.child.log_tail(lines)

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (the door drains for ``timeout`` s, default drain_timeout), SIGKILL 5 s later."""
        timeout = self.drain_timeout if timeout is None else timeout
        return self.child.stop(timeout + 5)
