"""server.supervisor: the one child-process primitive the launchers' roles are built on, on small
Python children (start, readiness, exit before ready, timeouts, stop with grace then kill)."""

from __future__ import annotations

import logging
import signal
import socket
import sys

import pytest

from server.supervisor import (
    DISCARD,
    FILE,
    PIPE,
    ChildProcess,
    NotReady,
    Service,
    _ephemeral_range,
    free_port,
    free_ports,
)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# Answers SIGTERM with exit code 3 once it has written its "ready" file.
TERM_3 = """
import signal, sys, time, pathlib
signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
print("starting", flush=True)
time.sleep(0.2)
pathlib.Path(sys.argv[1]).write_text("up")
while True:
    time.sleep(0.05)
"""


def test_ready_when_the_probe_answers_then_stopped_by_its_signal(tmp_path):
    ready = tmp_path / "ready"
    child = ChildProcess("child", tmp_path / "child.log", output=PIPE)
    child.start(_python(TERM_3) + [str(ready)])
    try:
        child.wait_ready(ready.is_file, timeout=30, interval=0.05)
        assert child.running() and child.pid is not None
    finally:
        code = child.stop(grace=10)
    assert code == 3 and not child.running()
    assert "starting" in child.log_tail() and "starting" in (tmp_path / "child.log").read_text()


def test_an_exit_before_ready_says_so_with_its_code_and_output(tmp_path):
    child = ChildProcess("child", tmp_path / "child.log", output=PIPE)
    child.start(_python("print('boom: no model file', flush=True); raise SystemExit(7)"))
    with pytest.raises(NotReady) as raised:
        child.wait_ready(lambda: False, timeout=30)
    assert raised.value.why == "exited" and raised.value.returncode == 7
    assert "boom: no model file" in child.log_tail()  # the reader has drained the pipe


def test_a_timeout_and_a_stop_request_are_told_apart(tmp_path):
    child = ChildProcess("child", output=DISCARD)
    child.start(_python("import time; time.sleep(60)"))
    try:
        with pytest.raises(NotReady) as raised:
            child.wait_ready(lambda: False, timeout=0.3, interval=0.05)
        assert raised.value.why == "timeout"
        with pytest.raises(NotReady) as raised:
            child.wait_ready(lambda: False, timeout=30, should_stop=lambda: True)
        assert raised.value.why == "stopped"
    finally:
        child.stop(grace=5)


def test_a_child_that_ignores_its_stop_signal_is_killed_after_the_grace(tmp_path, caplog):
    ready = tmp_path / "ready"
    code = (
        "import signal, time, pathlib, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "pathlib.Path(sys.argv[1]).write_text('up'); time.sleep(60)"
    )
    child = ChildProcess("stubborn child", output=DISCARD)
    child.start(_python(code) + [str(ready)])
    child.wait_ready(ready.is_file, timeout=30, interval=0.05)
    with caplog.at_level(logging.WARNING, logger="server.supervisor"):
        assert child.stop(grace=0.3) == -signal.SIGKILL
    assert "stubborn child did not stop in 0 s; killing it" in caplog.text
    assert child.stop() == -signal.SIGKILL  # stopping a stopped child is harmless


def test_file_output_is_appended_across_restarts_and_read_back_as_the_tail(tmp_path):
    child = ChildProcess("child", tmp_path / "logs" / "child.log", output=FILE)
    for n in (1, 2):
        child.start(_python(f"print('run {n}')"))
        assert child.process.wait(timeout=30) == 0
    assert child.log_tail(1) == "run 2\n" and child.log_tail(5) == "run 1\nrun 2\n"
    assert ChildProcess("never started", output=DISCARD).stop() is None


def test_the_service_context_manager_stops_what_never_became_ready():
    calls = []

    class Broken(Service):
        def start(self):
            calls.append("start")

        def wait_ready(self):
            calls.append("wait")
            raise RuntimeError("not ready")

        def stop(self):
            calls.append("stop")

    with pytest.raises(RuntimeError, match="not ready"):
        with Broken():
            pass
    assert calls == ["start", "wait", "stop"]


def test_free_port_is_outside_the_ephemeral_range_and_never_handed_out_twice():
    # Outgoing connections take their local ports from the ephemeral range: a port chosen
    # there could be taken between the choice and the child's bind.
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert not any(low <= port <= high for port in ports)
    with socket.socket() as s:  # each is free to bind
        s.bind(("127.0.0.1", ports[-1]))


def test_free_ports_are_distinct_and_not_taken():
    taken = {1}
    ports = free_ports(3, taken)
    assert len(set(ports)) == 3 and set(ports) <= taken and 1 not in ports


PDEATHSIG = """
import ctypes, os
value = ctypes.c_int()
ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
print("pdeathsig", value.value, "comm", open(f"/proc/{os.getpid()}/comm").read().strip(), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("setpriv", [True, False])
def test_a_tied_child_gets_its_signal_when_we_die_with_or_without_setpriv(tmp_path, monkeypatch, setpriv):
    import shutil

    from server import lifetime

    if setpriv and shutil.which("setpriv") is None:
        pytest.skip("util-linux's setpriv is not installed")
    if not setpriv:
        monkeypatch.setattr(lifetime.shutil, "which", lambda name: None)
    child = ChildProcess("child", tmp_path / "child.log", output=PIPE, tie="SIGTERM")
    child.start(_python(PDEATHSIG))
    child.process.wait(30)
    child.stop()
    # The child is the program itself (setpriv execs it), with the parent-death signal set.
    assert f"pdeathsig {int(signal.SIGTERM)} comm python" in child.log_tail(), child.log_tail()
