"""server.stubs: reading a python backend stub's command line (the watchdog's view of a stub)."""

from __future__ import annotations

import os
import subprocess
import sys

from server.stubs import find_stubs, model_and_instance, stub_of


def test_model_and_instance_from_the_stub_arguments():
    args = [
        "/x/backends/python/triton_python_backend_stub",
        "/repo/text_encoder/1/model.int8.onnx",
        "triton_onnxruntime_backend_shm_region_6bd3",
        "16777216",
        "16777216",
        "3566",
        "/x/backends/python",
        "336",
        "text_encoder_0_1",
        "/x/backends/onnxruntime",
    ]
    assert model_and_instance(args) == ("text_encoder", "text_encoder_0_1")
    resnet = [
        "stub",
        "/repo/image_classifier_resnet50/1/model.onnx",
        "shm",
        "1",
        "1",
        "9",
        "/b",
        "1",
        "image_classifier_resnet50_0_0",
        "/b",
    ]
    assert model_and_instance(resnet) == ("image_classifier_resnet50", "image_classifier_resnet50_0_0")
    # The auto-complete stub of a load has no instance name: the watchdog leaves it out.
    assert (
        model_and_instance(["stub", "/repo/text_encoder/1/model.py", "shm", "1", "1", "9", "/b", "1", "AUTOCOMPLETE_STUB", "/b"])[
            1
        ]
        == ""
    )


def test_a_process_that_is_not_a_stub_is_not_one():
    assert stub_of(os.getpid()) is None
    assert stub_of(2**22 + 12345) is None  # no such pid
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert find_stubs(os.getpid()) == []  # a child, but not a stub
    finally:
        child.kill()
        child.wait()


def test_the_watchdog_stops_quietly_when_its_tritonserver_dies(tmp_path, caplog):
    """A killed tritonserver takes its stubs with it: that is the launcher's to restart, and a scan
    could only fail on the repository API (it logged 'repository index: HTTP 0' tracebacks)."""
    import logging
    import time

    from server.stubs import StubWatchdog

    def process_running(pid: int) -> bool:  # as the watchdog's own check, written out here
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            return False
        return stat[stat.rfind(")") + 2] not in "ZX"

    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def reaches_the_server() -> None:  # what a scan asks of tritonserver, here: fails once it is gone
        if not process_running(server.pid):
            raise RuntimeError("repository index: HTTP 0")

    watchdog = StubWatchdog(
        server.pid,
        tmp_path,
        None,
        reload=lambda m: None,
        loaded=set,
        reaches=lambda m: [m],
        interval=0.05,
        extra_checks=[reaches_the_server],
    )
    with caplog.at_level(logging.INFO, logger="server.stubs"):
        watchdog.start()
        time.sleep(0.2)
        assert watchdog.alive() and process_running(server.pid)
        server.kill()  # not reaped yet: a zombie, as a SIGKILLed tritonserver is until its launcher waits
        deadline = time.monotonic() + 30  # a few 50 ms scans; generous for a busy machine
        while watchdog.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not watchdog.alive() and not process_running(server.pid)
        server.wait()
    assert "is gone; the watchdog stops" in caplog.text
    assert "scan failed" not in caplog.text
