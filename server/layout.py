"""Lay out a runnable Triton server from NVIDIA's ``nvidia-pytriton`` wheel.

The wheel ships tritonserver 2.51.0, the python backend, its stubs for several Python
versions and the local response cache. We copy the server folder to a writable place, put
the stub for the running Python next to the python backend, and install this project's
Python-based backends (``python_backends/triton_backends/<name>/model.py``) beside it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
PROJECT_BACKENDS = ROOT / "python_backends" / "triton_backends"


@dataclass(frozen=True)
class ServerLayout:
    root: Path  # the copied tritonserver folder
    libs: Path  # nvidia_pytriton.libs: shared libraries the binary needs

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def backends(self) -> Path:
        return self.root / "backends"

    @property
    def caches(self) -> Path:
        return self.root / "caches"


def find_pytriton() -> tuple[Path, Path]:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed in this Python; run `make venv` first")
    package = Path(list(spec.submodule_search_locations)[0])
    server = package / "tritonserver"
    libs = package.parent / "nvidia_pytriton.libs"
    if not (server / "bin" / "tritonserver").is_file():
        raise RuntimeError(f"no tritonserver binary in {server}; is nvidia-pytriton==0.7.0 installed?")
    return server, libs


def prepare(workdir: Path) -> ServerLayout:
    """Create (or refresh) the server layout under ``workdir``; cheap when already there."""
    source, libs = find_pytriton()
    target = workdir / "tritonserver"
    stamp = target / ".layout.json"
    wanted = {"pytriton": importlib.metadata.version("nvidia-pytriton"), "source": str(source)}
    current = json.loads(stamp.read_text()) if stamp.is_file() else None
    if current != wanted:
        log.info("laying out tritonserver %s in %s", wanted["pytriton"], target)
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "python_backend_stubs"))
        stamp.write_text(json.dumps(wanted))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = source / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton has no python backend stub for Python {version}")
    _copy_if_changed(stub, target / "backends" / "python" / "triton_python_backend_stub")
    layout = ServerLayout(target, libs)
    install_project_backends(layout)
    return layout


def install_project_backends(layout: ServerLayout) -> list[str]:
    """Copy each Python-based backend of the project to <backends>/<name>/model.py."""
    names = []
    for model_py in sorted(PROJECT_BACKENDS.glob("*/model.py")):
        name = model_py.parent.name
        if (layout.backends / name / f"libtriton_{name}.so").exists():
            continue  # a native backend of that name wins, as in NVIDIA's container
        _copy_if_changed(model_py, layout.backends / name / "model.py")
        names.append(name)
    return names


def _copy_if_changed(src: Path, dst: Path) -> None:
    if dst.is_file() and dst.read_bytes() == src.read_bytes():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)
