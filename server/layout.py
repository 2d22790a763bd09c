"""Lay out a runnable Triton server from NVIDIA's ``nvidia-pytriton`` wheel or an installed one.

The wheel ships tritonserver 2.51.0, the python backend, its stubs for several Python
versions and the local response cache. We copy the server folder to a writable place, put
the stub for the running Python next to the python backend, and install this project's
Python-based backends (``python_backends/triton_backends/<name>/model.py``) beside it.

An installed server (``home``: NVIDIA's container has it in /opt/tritonserver, with its native
backends and the python backend's stub for the container's Python) is run in place: its
binary, libraries and caches as they are, and a backends folder of our own under the work
folder with a link to each of its backends and this project's Python-based backends beside
them (a native backend of the same name wins).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
PROJECT_BACKENDS = ROOT / "python_backends" / "triton_backends"


@dataclass(frozen=True)
class ServerLayout:
    root: Path  # the laid-out folder under the work folder (the wheel's copy, or the backends' links)
    libs: Path  # shared libraries the binary needs (nvidia_pytriton.libs, or the install's lib/)
    home: Path | None = None  # an installed tritonserver run in place; None: the wheel's copy

    @property
    def binary(self) -> Path:
        return (self.home or self.root) / "bin" / "tritonserver"

    @property
    def backends(self) -> Path:
        return self.root / "backends"

    @property
    def caches(self) -> Path:
        return (self.home or self.root) / "caches"


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


def check_home(home: Path) -> Path:
    """``home`` as an installed tritonserver: its binary and backends folder must be there."""
    for needed in (home / "bin" / "tritonserver", home / "backends"):
        if not needed.exists():
            raise ValueError(f"--tritonserver-home (or $TRITONSERVER_HOME) {home}: no {needed.relative_to(home)} in it")
    return home


def prepare(workdir: Path, home: Path | None = None) -> ServerLayout:
    """Create (or refresh) the server layout under ``workdir``; cheap when already there.
    ``home``: an installed tritonserver (checked by :func:`check_home`) instead of the wheel."""
    if home is not None:
        return _prepare_installed(workdir, home)
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


def _prepare_installed(workdir: Path, home: Path) -> ServerLayout:
    target = workdir / "tritonserver-installed"
    backends = target / "backends"
    backends.mkdir(parents=True, exist_ok=True)
    installed = {entry.name: entry for entry in (home / "backends").iterdir() if entry.is_dir()}
    for entry in backends.iterdir():
        # A link of an earlier start whose backend is gone (another home), or a project backend
        # that the install now has natively: laid out again below.
        if entry.is_symlink() and installed.get(entry.name) != Path(os.readlink(entry)):
            entry.unlink()
        elif entry.is_dir() and not entry.is_symlink() and entry.name in installed:
            shutil.rmtree(entry)
    for name, source in installed.items():
        link = backends / name
        if not link.is_symlink():
            link.symlink_to(source, target_is_directory=True)
    layout = ServerLayout(target, home / "lib", home)
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
