"""A short run of perf.bench.speculative_bench: both engines answer both kinds of prompts, drafts are
proposed and accepted on the quoting answers, and the report is complete.

The structure and the draft counts are checked, never the speed ratios: these machines are
small and shared (the figures are in docs/generation-internals.md with the command behind them).
"""

from __future__ import annotations

import csv

import pytest

from perf.bench import speculative_bench

pytestmark = pytest.mark.perf


def test_short_speculative_bench_reports_both_engines_and_accepts_drafts(tmp_path):
    if not (speculative_bench.MODEL_DIR / "model.safetensors").is_file():
        pytest.fail("text_generation is not exported: run python -m export (make test does)", pytrace=False)
    code = speculative_bench.main(
        ["--requests", "2", "--max-tokens", "24", "--streams", "1,2", "--precision", "fp32", "--out-dir", str(tmp_path)]
    )
    summary = (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").is_file() else "(no summary.md)"
    assert code == 0, summary
    rows = list(csv.DictReader((tmp_path / "speculative.csv").open()))
    cells = {(r["kind"], int(r["streams"]), r["engine"]): r for r in rows}
    assert set(cells) == {(k, s, e) for k in ("quote", "chat") for s in (1, 2) for e in ("none", "drafts")}, summary
    for key, r in cells.items():
        assert int(r["tokens"]) > 0 and float(r["tokens_per_s"]) > 0, key
        assert 0 < float(r["steps_per_token"]) <= 1, key
    for s in (1, 2):
        none, drafts = cells[("quote", s, "none")], cells[("quote", s, "drafts")]
        assert int(none["drafted"]) == 0 and int(drafts["drafted"]) > 0, summary
        assert float(drafts["acceptance"]) > 0, summary
        assert float(drafts["steps_per_token"]) < float(none["steps_per_token"]), summary
    # FP32: the drafted answers are the same tokens as the plain ones.
    assert "| quote | 1 |" in summary and summary.count("| 2 of 2 |") == 4, summary
