"""A --quick run of perf.bench.compare: every system is measured in one run and the report is complete.

It starts its own servers (the naive one, then a tritonserver), one at a time, and checks
that the run produced a figure for each system and the ratios, never the figures' size:
these machines are small and shared.
"""

from __future__ import annotations

import csv

import pytest

from perf.bench import compare
from perf.lib import perf_analyzer as pa

pytestmark = pytest.mark.perf

EXPECTED = {
    "limit_encoder", "limit_e2e", "naive_http_c8", "triton_grpc_c8", "triton_http_c8", "triton_grpc_c4",
    "triton_grpc_rate", "triton_grpc_c4_nobatch",
}  # fmt: skip


def test_quick_compare_measures_every_system(tmp_path):
    try:
        pa.check()
    except pa.PerfAnalyzerNotAvailable as exc:
        pytest.fail(str(exc), pytrace=False)
    # Small concurrencies keep the naive server's windows short; the code paths are those of c32/c16.
    code = compare.main(
        ["--quick", "--concurrency", "8", "--batching-concurrency", "4", "--time-budget", "120", "--out-dir", str(tmp_path)]
    )
    summary = (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").is_file() else "(no summary.md)"
    assert code == 0, summary

    with (tmp_path / "summary.csv").open() as f:
        rows = {r["key"]: r for r in csv.DictReader(f)}
    assert set(rows) == EXPECTED, summary
    for key, row in rows.items():
        assert row["error"] == "", f"{key}: {row['error']}"
        assert float(row["throughput"]) > 0, key
        if row["protocol"] != "in-process":
            assert float(row["p99_ms"]) >= float(row["p50_ms"]) > 0, key
    # Dynamic batching really was off: one sequence per encoder execution.
    assert float(rows["triton_grpc_c4_nobatch"]["text_encoder_avg_batch"]) == 1.0
    assert float(rows["triton_grpc_c8"]["text_encoder_avg_batch"]) >= 1.0

    with (tmp_path / "ratios.csv").open() as f:
        ratios = {r["name"]: r for r in csv.DictReader(f)}
    assert len(ratios) == 7
    assert all(float(r["value"]) > 0 for r in ratios.values()), ratios
    assert "| ratio | value | target | met | from |" in summary
    for stem in ("naive_http_c8", "triton_grpc_c8", "triton_grpc_c4_nobatch", "triton_grpc_rate"):
        # An unstable first try leaves its log; the retry (twice the requests) its CSV and log.
        assert (tmp_path / f"{stem}.log").is_file(), stem
        assert (tmp_path / f"{stem}.csv").is_file() or (tmp_path / f"{stem}-retry.csv").is_file(), stem
    assert (tmp_path / "limit.csv").is_file() and (tmp_path / "tritonserver.log").is_file()
