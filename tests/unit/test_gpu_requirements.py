"""requirements-gpu.txt installs on a GPU host: every pin exists in the package registry, and
the TensorRT pin is the serving container's (a plan deserializes only under its own TensorRT).

The registry check asks pip itself (`pip index versions`, the index pip is configured with) for
each pinned version; nothing is downloaded or installed (the GPU wheels are several GB, and
PyPI's tensorrt-cu12-libs is a placeholder that fetches the real wheel from NVIDIA's index at
install time). Skipped, with the reason, where the registry cannot be reached.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from export.variants import SERVING_TENSORRT
from server.layout import ROOT

REQUIREMENTS = ROOT / "requirements-gpu.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)$")


def pins() -> dict[str, str]:
    found = {}
    for raw in REQUIREMENTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = PIN.match(line)
        assert match, f"requirements-gpu.txt: {line!r} is not an exact pin (name==version)"
        found[match.group(1).lower()] = match.group(2)
    return found


def available_versions(name: str) -> tuple[int, list[str], str]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    listed = re.search(r"^Available versions:\s*(.*)$", out.stdout, re.M)
    return out.returncode, [v.strip() for v in listed.group(1).split(",")] if listed else [], out.stderr


def test_every_gpu_requirement_is_an_exact_pin_and_tensorrt_is_the_containers():
    found = pins()
    assert {"onnxruntime-gpu", "tensorrt", "tensorrt-cu12", "tensorrt-cu12-libs", "tensorrt-cu12-bindings"} <= set(found)
    trt = {found[n] for n in found if n.startswith("tensorrt")}
    assert trt == {SERVING_TENSORRT}, f"TensorRT pins {trt} != the serving TensorRT {SERVING_TENSORRT}"


def test_every_gpu_pin_exists_in_the_registry():
    rc, versions, err = available_versions("pip")
    if rc != 0 or not versions:
        reason = f"package registry unreachable (pip index versions pip: rc {rc}, {err.strip()[-200:]})"
        print(reason)
        pytest.skip(reason)
    missing = []
    for name, version in pins().items():
        rc, versions, err = available_versions(name)
        if version not in versions:
            missing.append(f"{name}=={version} (registry has: {', '.join(versions[:8]) or err.strip()[-200:]})")
    assert not missing, "pins the registry does not have: " + "; ".join(missing)
