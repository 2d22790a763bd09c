"""The repository keeps its shape: files small enough to read, the benchmark harness smaller than
the product, one percentile, one place that starts tritonserver, and the gateway and clients free
of the backend library (what crosses hops is in ``contract``)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("contract", "python_backends", "server", "export", "openai_gateway", "clients", "ops", "model_repository")
PRODUCT_FILE_LINES = 800
PERF_FILE_LINES = 600
PERF_LINES = 10_350


def tracked(*folders: str) -> list[Path]:
    """The tracked Python files under ``folders`` (git's view: nothing generated or ignored)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--", *(f"{folder}/*.py" for folder in folders)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [ROOT / name for name in out.split("\0") if name]


def lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_the_file_lister_sees_the_product_and_the_harness():
    assert ROOT / "python_backends" / "generation" / "engine.py" in tracked(*PRODUCT)
    assert ROOT / "perf" / "lib" / "stats.py" in tracked("perf")


def test_no_product_file_is_over_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in tracked(*PRODUCT) if (n := lines(p)) > PRODUCT_FILE_LINES}
    assert not long, f"product files over {PRODUCT_FILE_LINES} lines: {long}; split them by role"


def test_the_benchmark_harness_stays_small():
    files = tracked("perf")
    long = {str(p.relative_to(ROOT)): n for p in files if (n := lines(p)) > PERF_FILE_LINES}
    assert not long, f"perf files over {PERF_FILE_LINES} lines: {long}"
    total = sum(lines(p) for p in files)
    assert total <= PERF_LINES, f"perf/ has {total} lines of Python, over {PERF_LINES}: lean on perf/lib"


def definitions(path: Path, name: str) -> int:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name for n in ast.walk(tree))


def test_one_percentile_in_the_repository():
    files = tracked(*PRODUCT, "perf", "tests", "scripts")
    defined = [str(p.relative_to(ROOT)) for p in files if definitions(p, "percentile")]
    assert defined == ["perf/lib/stats.py"], f"percentile defined in {defined}: use perf.lib.stats"
    numpy_ones = [str(p.relative_to(ROOT)) for p in files if re.search(r"np\.(percentile|quantile)\(", p.read_text())]
    assert not numpy_ones, f"{numpy_ones} compute their own percentile: use perf.lib.stats"


@pytest.mark.parametrize("folder", ["openai_gateway", "clients"])
def test_the_gateway_and_the_clients_do_not_import_the_backend_library(folder):
    offenders = []
    for path in tracked(folder):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "python_backends"]
    assert not offenders, f"the cross-hop contract lives in contract/, not python_backends: {offenders}"


def test_tritonserver_is_started_by_the_deployment_only():
    """``TritonServer(`` is constructed in server/ (the Deployment) alone; tests and benchmarks start a
    Deployment (tests/conftest.py, perf/lib/deployment.py)."""
    files = tracked(*PRODUCT, "perf", "tests", "scripts")
    here = Path(__file__)
    outside = [
        str(p.relative_to(ROOT))
        for p in files
        if p != here and not p.is_relative_to(ROOT / "server") and "TritonServer(" in p.read_text(encoding="utf-8")
    ]
    # test_server_layout.py tests the class itself.
    assert set(outside) <= {"tests/unit/test_server_layout.py"}, f"{outside} start tritonserver themselves"
