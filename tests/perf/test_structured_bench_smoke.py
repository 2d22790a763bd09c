"""A short run of perf.bench.structured_bench through tritonserver and the gateway: every enforced
answer is a valid object, both kinds of the cost run produce tokens, and the report is written.

The structure is checked, never the speed ratio: these machines are small and shared (the figures
are in docs/generation-internals.md with the command behind them)."""

from __future__ import annotations

import csv

import pytest

from perf.bench import structured_bench

pytestmark = pytest.mark.perf


def test_short_structured_bench_enforces_every_answer_and_measures_both_kinds(tmp_path):
    code = structured_bench.main(
        ["--prompts", "4", "--streams", "2", "--max-tokens", "8", "--rounds", "1", "--results", str(tmp_path)]
    )
    assert code == 0
    validity = {r["kind"]: r for r in csv.DictReader((tmp_path / "structured_validity.csv").open())}
    assert set(validity) == {"enforced", "not enforced"}
    assert validity["enforced"]["valid"] == validity["enforced"]["total"] == "4"
    cost = {r["kind"]: r for r in csv.DictReader((tmp_path / "structured_cost.csv").open())}
    assert set(cost) == {"no guide", "json schema"}
    assert all(int(r["tokens"]) == 2 * 8 and float(r["tokens_per_s"]) > 0 for r in cost.values()), cost
