"""perf.compare is one measuring tool; the code the tools share is perf.harness. The other tools
import the harness, not the compare tool (which once was the framework they all imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"


def imported(source: str) -> set[str]:
    """The modules a source file imports, ``from perf import compare`` as ``perf.compare``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_import_reader_sees_both_forms():
    assert {"perf.compare", "perf.harness"} <= imported("from perf import compare\ndef f():\n    import perf.harness\n")


@pytest.mark.parametrize("tool", ["sweep", "autotune", "trace_report"])
def test_tools_share_the_harness_not_the_compare_tool(tool):
    modules = imported((PERF / f"{tool}.py").read_text(encoding="utf-8"))
    assert "perf.harness" in modules, f"perf/{tool}.py no longer uses perf.harness"
    assert "perf.compare" not in modules, f"perf/{tool}.py imports perf.compare, a tool: take the shared code from perf.harness"
