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
