"""Code the Python backend stubs import must run on NVIDIA's 24.10 container (Python 3.10)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB_CODE = sorted([*(ROOT / "python_backends").rglob("*.py"), *(ROOT / "model_repository").rglob("model.py")])
PY311_ONLY_MODULES = {"tomllib", "wsgiref.types"}
HOST_ONLY = {"export", "server", "clients", "ops", "perf"}
# The generation engine runs its model in PyTorch by design, so it may import torch; the image
# installs torch once a served model uses this package. Nothing else in the stubs may.
TORCH_ALLOWED = ROOT / "python_backends" / "generation"


@pytest.mark.parametrize("path", STUB_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_parses_as_python_310_and_imports_nothing_newer(path):
    tree = ast.parse(path.read_text(), feature_version=(3, 10))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & PY311_ONLY_MODULES
    # python_backends must not import the host-only packages (export needs torch and 3.11)
    forbidden = HOST_ONLY if path.is_relative_to(TORCH_ALLOWED) else HOST_ONLY | {"torch"}
    offending = sorted(m for m in imported if m.split(".")[0] in forbidden)
    assert not offending, f"{path.relative_to(ROOT)} imports host-only packages {offending}"
