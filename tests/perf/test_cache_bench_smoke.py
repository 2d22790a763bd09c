"""A short run of perf.bench.cache_bench: every phase ran and the report holds sane figures.

It starts its own servers (without cache, then with cache and a redis-server), one at a time.
Checked: no errors, the hit rates the workload implies (a warm L2 answers a new replica, the
hits-only phase is all hits), and that each figure exists; never the figures' size.
"""

from __future__ import annotations

import json

import pytest

from perf.bench import cache_bench

pytestmark = pytest.mark.perf


def test_short_cache_bench_reports_every_phase_and_level(tmp_path):
    rc = cache_bench.main(
        ["--requests", "400", "--hit-requests", "200", "--concurrency", "4", "--no-export", "--results-dir", str(tmp_path)]
    )
    assert rc == 0
    summary = json.loads((tmp_path / "results.json").read_text())
    phases = {p["phase"]: p for p in summary["phases"]}
    assert list(phases) == ["without cache", "with cache (cold start)", "new replica (empty L1, warm L2)", "hits only"]
    assert all(p["errors"] == 0 and p["rps"] > 0 and 0 < p["p50_ms"] <= p["p99_ms"] for p in phases.values())
    assert summary["throughput_ratio"] > 0
    cold, replica, hits = (phases[n]["levels"] for n in list(phases)[1:])
    # Cold: the first occurrence of each sentence is computed by the model, and only those.
    distinct = round((1 - summary["repeat_fraction"]) * 400)
    assert distinct <= cold["model_texts"] <= distinct + 20  # + texts in flight twice at concurrency 4
    assert 0 < cold["l1_hit_rate"] < 1
    assert replica["l2_hit_rate"] >= 0.9 and replica["l1_hit"] > 0
    assert hits["overall_hit_rate"] == 1.0 and hits["model_texts"] == 0
    assert phases["hits only"]["server_compute_us"] > 0 and phases["hits only"]["lookup_us"] > 0
    assert "Throughput ratio with/without cache" in (tmp_path / "summary.md").read_text()
