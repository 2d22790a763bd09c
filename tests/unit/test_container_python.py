"""Code the Python backend stubs import must run on NVIDIA's 24.10 container (Python 3.10)."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB_CODE = sorted(
    [
        *(ROOT / "contract").rglob("*.py"),
        *(ROOT / "python_backends").rglob("*.py"),
        *(ROOT / "model_repository").rglob("model.py"),
    ]
)
PY311_ONLY_MODULES = {"tomllib", "wsgiref.types"}
HOST_ONLY = {"export", "server", "clients", "ops", "perf", "openai_gateway"}
# The generation engine runs its model in PyTorch by design, so it may import torch; the image
# installs torch once a served model uses this package. Nothing else in the stubs may.
TORCH_ALLOWED = ROOT / "python_backends" / "generation"


@pytest.mark.parametrize("path", STUB_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_parses_as_python_310_and_imports_nothing_newer(path):
    tree = ast.parse(path.read_text(), feature_version=(3, 10))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & PY311_ONLY_MODULES
    # the stubs' code must not import the host-only packages (export needs torch and 3.11)
    forbidden = HOST_ONLY if path.is_relative_to(TORCH_ALLOWED) else HOST_ONLY | {"torch"}
    offending = sorted(m for m in imported if m.split(".")[0] in forbidden)
    assert not offending, f"{path.relative_to(ROOT)} imports host-only packages {offending}"


CONTRACT_USERS = ("openai_gateway", "clients")


@pytest.mark.parametrize("package", CONTRACT_USERS)
def test_the_gateway_and_the_clients_import_the_contract_not_the_backends(package):
    """What crosses hops lives in contract/; the gateway's and the clients' images carry no backend code."""
    offending = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        offending += [f"{path.relative_to(ROOT)}: {m}" for m in sorted(imported) if m.split(".")[0] == "python_backends"]
    assert not offending, offending


def test_the_contract_imports_only_the_standard_library_and_numpy():
    allowed = {"contract", "numpy", "__future__"}
    for path in sorted((ROOT / "contract").rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        outside = sorted(m for m in imported if m.split(".")[0] not in allowed and m.split(".")[0] not in sys.stdlib_module_names)
        assert not outside, f"{path.relative_to(ROOT)} imports {outside}"
