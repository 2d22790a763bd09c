"""Smoke sweeps with perf_analyzer against a real tritonserver.

They check that a sweep runs end to end and its figures are sane, never absolute numbers:
these machines are small and shared.
"""

from __future__ import annotations

import csv

import pytest

from perf.bench import baseline
from perf.lib import perf_analyzer as pa
from perf.lib import triton_stats
from perf.lib.paths import SENTENCES_16TOK

pytestmark = pytest.mark.perf

# Short and loose: a few seconds per level, stabilisation that a noisy machine meets.
# perf_analyzer needs 3 consecutive windows within -s of each other; with max_trials=3 the first
# three had to be, and one neighbour's burst on this shared machine failed a fresh-clone run.
QUICK = dict(request_count=60, stability_percent=100, max_trials=6, timeout_s=120)


@pytest.fixture(scope="module")
def perf_analyzer():
    try:
        return pa.check()
    except pa.PerfAnalyzerNotAvailable as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_one_level_gives_sane_figures(triton, perf_analyzer, protocol, tmp_path):
    binary, env = perf_analyzer
    url = triton.grpc_url if protocol == "grpc" else triton.http_url
    settings = pa.Settings(model="text_embedding", url=url, protocol=protocol, concurrency=2, input_data=SENTENCES_16TOK, **QUICK)
    before = triton_stats.snapshot(triton.http_url)
    m = pa.measure(settings, tmp_path / "c2.csv", log_path=tmp_path / "c2.log", binary=binary, env=env)
    served = triton_stats.fetch_delta(triton.http_url, before)
    assert m.concurrency == 2
    assert m.throughput > 0
    assert 0 < m.p50_ms <= m.p90_ms <= m.p95_ms <= m.p99_ms
    ensemble = served.pop("text_embedding")
    assert ensemble.inference_count > 0
    # The ensemble's steps (no router outside a rollout).
    assert sorted(served) == ["text_encoder", "text_tokenizer"]
    for stats in served.values():
        # Every request passes every step, and no step ran more executions than inferences.
        assert stats.success_count == stats.inference_count >= ensemble.success_count * 0.9
        assert stats.avg_batch is not None and 1.0 <= stats.avg_batch
    assert (tmp_path / "c2.csv").is_file() and "Composing models" in (tmp_path / "c2.log").read_text()


def test_baseline_script_against_running_server(triton, perf_analyzer, tmp_path):
    code = baseline.main(
        [
            "--url", triton.grpc_url,
            "--concurrency", "1,4",
            "--request-count", "60",
            "--stability-percent", "100",
            "--max-trials", "3",
            "--time-budget", "180",
            "--out-dir", str(tmp_path),
        ]
    )  # fmt: skip
    summary = (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").is_file() else "(no summary.md)"
    assert code == 0, summary
    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["kind"], int(r["concurrency"])) for r in rows] == [("concurrency", 1), ("concurrency", 4)], summary
    for row in rows:
        assert row["error"] == ""
        assert float(row["throughput"]) > 0
        assert float(row["p99_ms"]) >= float(row["p50_ms"]) > 0
    assert "| system | protocol | load | throughput (infer/s) | p50 (ms) | p99 (ms) |" in summary
    stems = [f"text_embedding-16tok-grpc-c{c}" for c in (1, 4)]
    assert {p.name for p in tmp_path.iterdir()} >= {f"{s}.{x}" for s in stems for x in ("csv", "log")} | {"summary.md"}
