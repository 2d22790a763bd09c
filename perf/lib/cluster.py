"""serve-cluster as a target: ``launch`` starts `python -m server.cluster` as a child process on free
ports with its own work folder and returns a ``ClusterRun`` once every replica is ready (its screen
kept, cluster.json read on demand). The drills (chaos and its failover scenario) and the cluster tests start it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from perf.lib.paths import ROOT
from server.supervisor import free_ports


@dataclass
class ClusterRun:
    """A `python -m server.cluster` child process on free ports."""

    proc: subprocess.Popen
    workdir: Path
    ports: dict[str, int]
    screen: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def state(self) -> dict:
        return json.loads((self.workdir / "cluster.json").read_text(encoding="utf-8"))

    def stop(self, timeout: float = 60.0) -> int:
        """SIGINT (Ctrl-C), as a user stops it; SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        return self.proc.returncode


def launch(
    workdir: Path,
    replicas: int = 2,
    models=("text_embedding",),
    gateway: bool = True,
    prometheus: bool = True,
    scrape_interval: float = 2.0,
    timeout: float = 300.0,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    rollout_state: Path | None = None,
) -> ClusterRun:
    """Start the cluster and return once its first screen is printed (all replicas ready).
    ``rollout_state``: the replicas' rollout state file (default: none, a fresh path)."""
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ports = dict(zip(("http", "grpc", "metrics", "gateway", "prometheus"), free_ports(5, set())))
    options = {f"--{name}-port": port for name, port in ports.items()} | {
        "--replicas": replicas,
        "--workdir": workdir / "cluster",
        "--scrape-interval": scrape_interval,
        "--repository-token-file": workdir / "repository-token",
        "--gateway-api-key-file": workdir / "gateway-api-key",
        "--rollout-state": rollout_state or workdir / "no-rollout-state.json",
        "--drain-timeout": 5,
    }
    cmd = [sys.executable, "-m", "server.cluster", "--no-export", *(a for o, v in options.items() for a in (o, str(v)))]
    cmd += [a for m in models for a in ("--model", m)] + (extra or [])
    cmd += ([] if gateway else ["--no-gateway"]) + ([] if prometheus else ["--no-prometheus"])
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    run = ClusterRun(proc, workdir / "cluster", ports)
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            run.screen.append(line.rstrip("\n"))
            if "Ctrl-C to stop" in line:
                ready.set()
        ready.set()

    run._reader = threading.Thread(target=read, daemon=True)
    run._reader.start()
    if not ready.wait(timeout) or proc.poll() is not None:
        run.stop(timeout=10)
        raise RuntimeError("serve-cluster did not become ready:\n" + "\n".join(run.screen[-60:]))
    return run
