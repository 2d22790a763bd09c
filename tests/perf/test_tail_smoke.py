"""A short run of perf.tail: both phases on their own servers, every figure present and sane.

Asserts that the benchmark ran and wrote its table, never the size of the figures (these
machines are small and shared); the before/after comparison itself is docs/performance.md.
"""

from __future__ import annotations

import csv

import pytest

from perf import tail

pytestmark = pytest.mark.perf


def test_before_repository_adds_the_stall_settings_only_to_batching_configs(tmp_path):
    repo = tail.before_repository(tail.ROOT / "model_repository", tmp_path / "repo")
    tokenizer = (repo / "text_tokenizer" / "config.pbtxt").read_text()
    assert "priority_levels: 2" in tokenizer and "allow_timeout_override: true" in tokenizer
    assert "priority_levels" not in (repo / "text_embedding" / "config.pbtxt").read_text()  # an ensemble
    assert (repo / "text_tokenizer" / "1").is_symlink()
    assert "priority_levels" not in (tail.ROOT / "model_repository" / "text_tokenizer" / "config.pbtxt").read_text()


def test_short_tail_run_measures_both_phases(tmp_path):
    code = tail.main(["--workloads", "text_tokenizer,text_embedding_cached_hits", "--concurrency", "4",
                      "--duration", "1.5", "--warmup", "0.5", "--out-dir", str(tmp_path)])
    summary = (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").is_file() else "(no summary.md)"
    assert code == 0, summary
    with (tmp_path / "tail.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {(r["phase"], r["workload"]) for r in rows} == {
        (p, w) for p in ("after", "before") for w in ("text_tokenizer", "text_embedding_cached_hits")}, summary
    for r in rows:
        p50, p99, peak = float(r["p50_ms"]), float(r["p99_ms"]), float(r["max_ms"])
        assert int(r["requests"]) > 0 and int(r["errors"]) == 0, r
        assert 0 < p50 <= p99 <= peak, r
        assert float(r["rps"]) > 0, r
    assert "P99 <= 50 ms" in summary  # the targets table (checked at the highest concurrency)
    assert (tmp_path / "tritonserver-after.log").is_file() and (tmp_path / "tritonserver-before.log").is_file()
