"""A --quick run of perf.bench.sweep: both sweep kinds measured, CSV, summary and plots written.

Starts its own tritonserver; checks that the figures are sane, never their size (these
machines are small and shared).
"""

from __future__ import annotations

import csv

import pytest

from perf.bench import sweep
from perf.lib import perf_analyzer as pa

pytestmark = pytest.mark.perf


def test_quick_sweep_writes_points_and_plots(tmp_path):
    try:
        pa.check()
    except pa.PerfAnalyzerNotAvailable as exc:
        pytest.fail(str(exc), pytrace=False)
    code = sweep.main(["--quick", "--time-budget", "70", "--out-dir", str(tmp_path)])
    summary = (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").is_file() else "(no summary.md)"
    assert code == 0, summary

    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["kind"] for r in rows} == {"concurrency", "rate"}, summary
    assert {r["data"] for r in rows} == {"16tok", "mixed"}, summary
    for row in rows:
        assert row["error"] == "", row
        assert float(row["throughput"]) > 0, row
        assert float(row["p99_ms"]) >= float(row["p50_ms"]) > 0, row
    assert "| text_embedding-16tok | grpc | Poisson " in summary and "Peak of text_embedding-mixed: grpc" in summary
    assert "| text_encoder |" in summary  # the server side, per step

    for data in ("16tok", "mixed"):
        for kind in ("throughput_vs_concurrency", "latency_vs_throughput"):
            png = tmp_path / f"{kind}_text_embedding-{data}.png"
            assert png.is_file() and png.stat().st_size > 1000, png
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
