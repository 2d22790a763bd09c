"""A short run of perf.bench.priority_bench: every phase and class measured, refusals only as
UNAVAILABLE. Whether interactive kept its budget is the benchmark's finding on a given
machine (docs/performance.md), not asserted here."""

from __future__ import annotations

import json
import shutil

import pytest

from perf.bench import priority_bench

pytestmark = pytest.mark.perf


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (scripts/setup.sh installs it)")
def test_a_short_run_measures_every_class_and_refuses_only_with_unavailable(tmp_path):
    code = priority_bench.main(["--duration", "4", "--flood-connections", "128", "--probe-rate", "10", "--out", str(tmp_path)])
    assert code in (0, 1)
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["peak"]["rate"] > 0
    rows = {(r["phase"], r["class"]): r for r in result["rows"]}
    assert set(rows) == {("alone", "interactive"), ("overload", "interactive"), ("overload", "default"), ("overload", "bulk")}
    assert all(r["sent"] > 0 and r["other_errors"] == 0 for r in rows.values()), rows
    for cls in ("default", "bulk"):
        assert result["flood"][cls]["other"] == 0 and result["flood"][cls]["socket_errors"] == 0
    assert result["flood"]["bulk"]["refused_rate"] > 0, "a flood over bulk's 16 rows is refused"
    assert "| overload | interactive (50 ms) |" in (tmp_path / "summary.md").read_text()
