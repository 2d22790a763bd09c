"""perf/'s rooms keep their direction: the shared library (perf.lib) imports no tool, a tool's shared
code is taken from the library and not from another room's tool, and no two perf modules import
each other. perf.bench.compare is one measuring tool; the code the tools share is perf.lib.harness
(compare once was the framework they all imported; tail and gateway_bench once imported each other)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PERF = ROOT / "perf"


def imported(source: str) -> set[str]:
    """The modules a source file imports, ``from perf import compare`` as ``perf.compare``; imports
    under ``if TYPE_CHECKING:`` are annotations only and are left out."""
    tree = ast.parse(source)
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@functools.cache
def perf_modules() -> dict[str, set[str]]:
    """Every perf module (``perf.bench.tail``) and the perf modules it imports."""
    modules = {}
    for path in PERF.rglob("*.py"):
        if "results" in path.parts:
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = imported(path.read_text(encoding="utf-8"))
    return {name: {m for m in found if m in modules and m != name} for name, found in modules.items()}


def test_the_import_reader_sees_both_forms_and_skips_type_checking():
    source = (
        "from typing import TYPE_CHECKING\nfrom perf.bench import compare\n"
        "def f():\n    import perf.lib.harness\n"
        "if TYPE_CHECKING:\n    from perf.baselines.limit import Limit\n"
    )
    found = imported(source)
    assert {"perf.bench.compare", "perf.lib.harness"} <= found
    assert "perf.baselines.limit" not in found


@pytest.mark.parametrize("tool", ["sweep", "autotune"])
def test_tools_share_the_harness_not_the_compare_tool(tool):
    modules = imported((PERF / "bench" / f"{tool}.py").read_text(encoding="utf-8"))
    assert "perf.lib.harness" in modules, f"perf/bench/{tool}.py no longer uses perf.lib.harness"
    assert "perf.bench.compare" not in modules, (
        f"perf/bench/{tool}.py imports perf.bench.compare, a tool: take the shared code from perf.lib.harness"
    )


def test_the_library_imports_no_tool():
    for name, deps in perf_modules().items():
        if name.startswith("perf.lib"):
            above = sorted(d for d in deps if not d.startswith("perf.lib"))
            assert not above, f"{name} (the shared library) imports {above}: move what it needs into perf.lib"


def test_no_room_takes_code_from_a_benchmark():
    for name, deps in perf_modules().items():
        if not name.startswith("perf.bench"):
            tools = sorted(d for d in deps if d.startswith("perf.bench"))
            assert not tools, f"{name} imports the benchmark(s) {tools}: shared code belongs in perf.lib"


def test_no_two_perf_modules_import_each_other():
    graph = perf_modules()
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        seen[name] = 1
        for dep in sorted(graph[name]):
            if seen.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError("perf modules import each other: " + " -> ".join(cycle))
            if dep not in seen:
                visit(dep, path + [dep])
        seen[name] = 2

    for name in sorted(graph):
        if name not in seen:
            visit(name, [name])
