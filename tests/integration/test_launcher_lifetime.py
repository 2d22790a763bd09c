"""The launcher's children die with it: SIGKILL the launcher -> tritonserver and nginx gone and
the ports free within 10 s; SIGTERM -> a bounded, printed drain and exit 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from server.layout import ROOT
from server.process import ServerOptions
from tests.integration.launcher_command import launcher_command


def _launch(tmp_path: Path) -> tuple[subprocess.Popen, ServerOptions]:
    ports = ServerOptions.with_free_ports()
    cmd = launcher_command(
        tmp_path,
        ports,
        "--no-export",
        "--quiet",
        "--model",
        "text_tokenizer",
        "--drain-timeout",
        "5",
        "--repository-token-file",
        str(tmp_path / "token"),
        "--rollout-state",
        str(tmp_path / "no-state.json"),
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + 240
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Ctrl-C to stop" in line:
            return proc, ports
    proc.kill()
    raise AssertionError("launcher not ready:\n" + "".join(lines) + proc.stderr.read())


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_sigkill_of_the_launcher_takes_tritonserver_and_nginx_with_it(tmp_path):
    proc, ports = _launch(tmp_path)
    descendants = _children(proc.pid)
    names = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in descendants if _alive(pid)}
    assert "tritonserver" in names.values() and "nginx" in names.values(), names
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (any(_alive(p) for p in names) or _listening(ports.http_port)):
        time.sleep(0.2)
    left = {pid: name for pid, name in names.items() if _alive(pid)}
    for pid in left:  # do not leave them behind for the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running 10 s after the launcher was killed: {left}"
    for port in (ports.http_port, ports.grpc_port, ports.metrics_port):
        assert not _listening(port), f"port {port} still open"


def test_sigterm_drains_within_the_bound_and_exits_0(tmp_path):
    proc, _ = _launch(tmp_path)
    names = [pid for pid in _children(proc.pid) if _alive(pid)]
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, out + err
    assert "draining in-flight requests (at most 5 s each" in out
    assert "tritonserver stopped (exit code 0)" in out
    assert elapsed < 5 + 5 + 10, elapsed
    assert not [pid for pid in names if _alive(pid)]
