"""A short run of perf.bench.length_mix against the perf tier's server, and its before repository.

Asserts that the benchmark ran and wrote its figures, never their size (these machines are
small and shared); the before/after comparison itself is docs/performance.md.
"""

from __future__ import annotations

import csv

import pytest

from perf.baselines import limit
from perf.bench import length_mix

pytestmark = pytest.mark.perf


def test_before_repository_drops_ragged_batching_from_the_encoder_only(tmp_path):
    repo = length_mix.before_repository(length_mix.ROOT / "model_repository", tmp_path / "repo")
    encoder = (repo / "text_encoder" / "config.pbtxt").read_text()
    assert "allow_ragged_batch: true" not in encoder and 'key: "max_batch_tokens"' not in encoder
    for variant in (repo / "text_encoder" / "configs").glob("*.pbtxt"):
        assert "allow_ragged_batch: true" not in variant.read_text()
    assert (repo / "text_encoder" / "1").is_symlink()
    shipped = length_mix.ROOT / "model_repository"
    assert "allow_ragged_batch: true" in (shipped / "text_encoder" / "config.pbtxt").read_text()
    assert (repo / "text_tokenizer" / "config.pbtxt").resolve() == (shipped / "text_tokenizer" / "config.pbtxt").resolve()


def test_mixed_texts_span_the_mix():
    tokenizer = limit.served_tokenizer()
    lengths = limit.mix_lengths(40, 8, 128, seed=3)
    texts = length_mix.mixed_texts(lengths, tokenizer, seed=3)
    counts = tokenizer.encode(texts).lengths.tolist()
    for want, got in zip(lengths, counts):
        assert max(3, want - 8) <= got <= want


def test_short_run_against_a_server_reports_both_workloads_and_the_ratio(triton, tmp_path):
    url = getattr(triton, "triton_http_url", None) or triton.http_url
    code = length_mix.main(
        [
            "--url",
            url,
            "--rounds",
            "1",
            "--duration",
            "1",
            "--warmup",
            "0",
            "--concurrency",
            "4",
            "--limit-rounds",
            "1",
            "--limit-pool",
            "8",
            "--limit-seconds",
            "0.05",
            "--budgets",
            "2048",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    rows = list(csv.DictReader((tmp_path / "length_mix.csv").open()))
    assert {r["workload"] for r in rows} == {"text_encoder", "text_embedding"}
    assert all(int(r["requests"]) > 0 and int(r["errors"]) == 0 for r in rows)
    summary = (tmp_path / "summary.md").read_text()
    assert "| text_encoder | url | 4 |" in summary and "limit:" in summary
    limit_rows = list(csv.DictReader((tmp_path / "limit.csv").open()))
    assert {r["grouping"] for r in limit_rows} == {"tokens<=2048", "count=16", "alone"}
