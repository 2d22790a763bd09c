"""requirements-gpu.txt, the GPU swap `make venv GPU=1` installs (scripts/setup.sh).

Offline (what pip would read, checked here without it): every line an exact pin pip parses;
the TensorRT pins the serving container's (a plan deserializes only under its own TensorRT);
no package pinned in the CPU set (requirements.txt, -perf, -dev, constraints.txt) with another version, and
onnxruntime-gpu only in the GPU set, onnxruntime only in the CPU one (they install the same
package folder: setup.sh swaps one for the other); one CUDA major in every ``cuNN`` package of
both sets; NVIDIA's index named (PyPI's tensorrt-cu12-libs is a placeholder that fetches the
real wheel from there); the file the set-up installs.

Online (marked ``network``; `-m "not network"` leaves it out explicitly): every pin exists in the
package registry pip is configured with (`pip index versions`; nothing is downloaded: the GPU
wheels are several GB). Unreachable, it skips, and under STRICT_SKIPS=1 (make test) that skip
fails: an offline run does not read as a checked registry.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from export.variants import SERVING_TENSORRT
from server.layout import ROOT
from tests.conftest import skip_fails_when_strict

REQUIREMENTS = ROOT / "requirements-gpu.txt"
# The CPU set `make venv` installs: the runtime set and pyproject.toml's groups perf and dev, with the lock.
CPU_FILES = tuple(ROOT / f for f in ("requirements.txt", "requirements-perf.txt", "requirements-dev.txt", "constraints.txt"))
NVIDIA_INDEX = "https://pypi.nvidia.com"
# No stderr in the reason: pip's error names pypi.nvidia.com, and a reason naming NVIDIA reads as
# a hardware skip that stands under STRICT_SKIPS.
REGISTRY_UNREACHABLE = "package registry unreachable (pip index versions pip: rc {rc})"


def requirement_lines(path) -> list[str]:
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            lines.append(line)
    return lines


def pins(path=REQUIREMENTS) -> dict[str, str]:
    """canonical name -> version of each line, each an exact pin (name==version) that pip parses."""
    found = {}
    for line in requirement_lines(path):
        req = Requirement(line)  # pip's own parser (packaging); raises on what pip would refuse
        (spec,) = req.specifier if len(req.specifier) == 1 else (None,)
        assert spec is not None and spec.operator == "==" and "*" not in spec.version, (
            f"{path.name}: {line!r} is not an exact pin (name==version)"
        )
        assert not req.marker, f"{path.name}: {line!r}: a marker would skip it on some hosts"
        Version(spec.version)  # a valid version, or InvalidVersion
        name = canonicalize_name(req.name)
        assert name not in found, f"{path.name}: {req.name} pinned twice"
        found[name] = spec.version
    return found


def test_every_gpu_requirement_is_an_exact_pin_and_tensorrt_is_the_containers():
    found = pins()
    assert {"onnxruntime-gpu", "tensorrt", "tensorrt-cu12", "tensorrt-cu12-libs", "tensorrt-cu12-bindings"} <= set(found)
    trt = {found[n] for n in found if n.startswith("tensorrt")}
    assert trt == {SERVING_TENSORRT}, f"TensorRT pins {trt} != the serving TensorRT {SERVING_TENSORRT}"


def test_the_gpu_pins_agree_with_the_cpu_set():
    gpu = pins()
    cpu: dict[str, str] = {}
    for path in CPU_FILES:
        for name, version in pins(path).items():
            assert cpu.setdefault(name, version) == version, f"{name}: {cpu[name]} and {version} in the CPU set"
    clash = {n: (gpu[n], cpu[n]) for n in gpu.keys() & cpu.keys() if gpu[n] != cpu[n]}
    assert not clash, f"pinned differently in requirements-gpu.txt and the CPU set (gpu, cpu): {clash}"
    # The swap: one ONNX Runtime wheel in each set, never both in one.
    assert "onnxruntime" in cpu and "onnxruntime" not in gpu
    assert "onnxruntime-gpu" in gpu and "onnxruntime-gpu" not in cpu
    # One CUDA major across both sets (TensorRT's cu12 wheels, the CUDA runtime perf_analyzer links).
    majors = {m.group(1): n for n in {*gpu, *cpu} for m in [re.search(r"-cu(\d+)(?:-|$)", n)] if m}
    assert len(majors) == 1, f"packages for different CUDA majors: {majors}"


def test_nvidias_index_is_named_and_the_set_up_installs_this_file():
    options = [line.split() for line in REQUIREMENTS.read_text().splitlines() if line.startswith("-")]
    assert ["--extra-index-url", NVIDIA_INDEX] in options, options
    assert all(option[0] == "--extra-index-url" for option in options), options  # nothing else changes pip's index
    gpu_branch = (ROOT / "scripts" / "setup.sh").read_text().split('if [ "$GPU" = 1 ]', 1)[1]
    assert "-r requirements-gpu.txt" in gpu_branch
    (stamp,) = [line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("$(STAMP):")]
    assert "requirements-gpu.txt" in stamp.split()  # a changed pin reruns the set-up


def test_a_registry_skip_fails_under_strict_skips():
    assert skip_fails_when_strict(REGISTRY_UNREACHABLE.format(rc=1))


def available_versions(name: str) -> tuple[int, list[str], str]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    listed = re.search(r"^Available versions:\s*(.*)$", out.stdout, re.M)
    return out.returncode, [v.strip() for v in listed.group(1).split(",")] if listed else [], out.stderr


@pytest.mark.network
def test_every_gpu_pin_exists_in_the_registry():
    rc, versions, err = available_versions("pip")
    if rc != 0 or not versions:
        print(f"pip index versions pip: rc {rc}: {err.strip()[-400:]}")
        pytest.skip(REGISTRY_UNREACHABLE.format(rc=rc))
    missing = []
    for name, version in pins().items():
        rc, versions, err = available_versions(name)
        if version not in versions:
            missing.append(f"{name}=={version} (registry has: {', '.join(versions[:8]) or err.strip()[-200:]})")
    assert not missing, "pins the registry does not have: " + "; ".join(missing)
