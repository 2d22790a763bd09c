"""A tiny run of perf.bench.gateway_bench: every system answers, the report is complete and its figures sane.

It starts its own tritonserver (text_embedding_cached, text_embedding), two gateways and the
embeddings peer (infinity-emb, INT8 and FP32: installed into its own virtualenv on first use), runs
one short round of every embeddings system, and checks the structure of the JSON and the table, never the figures' size: these machines are
small and shared.
"""

from __future__ import annotations

import json

import pytest

from perf.bench import gateway_bench
from perf.bench.gateway_bench import EMBED_SYSTEMS, WORKLOADS

pytestmark = pytest.mark.perf


def test_tiny_gateway_bench_measures_every_system(tmp_path):
    out = tmp_path / "gateway"
    code = gateway_bench.main(
        [
            "--rounds",
            "1",
            "--embed-duration",
            "1",
            "--embed-concurrency",
            "4",
            "--out",
            str(out),
        ]
    )
    table = (out / "summary.md").read_text() if (out / "summary.md").is_file() else "(no table)"
    assert code == 0, table
    result = json.loads((out / "results.json").read_text())
    assert result["error"] == "", result["error"]

    embed = {(c["workload"], c["system"]): c for c in result["embeddings"]}
    assert set(embed) == {(w, s) for w in WORKLOADS for s in EMBED_SYSTEMS}, table
    for (workload, system), c in embed.items():
        where = f"{workload}/{system}: {c['first_error']}"
        assert c["errors"] == 0 and c["requests"] > 0 and c["requests_per_s"] > 0, where
        assert c["max_ms"] >= c["p99_ms"] >= c["p50_ms"] > 0, where
    # Cache hits answer faster than misses, through either door: the workloads are what they claim.
    for system in ("direct", "gateway"):
        assert embed[("repeated", system)]["p50_ms"] < embed[("unique", system)]["p50_ms"], table

    names = {r["name"]: r for r in result["ratios"]}
    for name in (
        "embeddings unique, gateway / direct throughput, c4",
        "embeddings repeated, gateway / direct P99, c4",
        "embeddings unique, direct / infinity throughput, c4",
        "embeddings unique, gateway / infinity_fp32 P99, c4",
    ):
        assert names[name]["value"] > 0, names.get(name)
    assert "| ratio | value | target | met | from |" in table
    logs = ("tritonserver", "gateway-quiet", "gateway-log", "peer-infinity", "peer-infinity_fp32")
    assert all((out / f"{name}.log").is_file() for name in logs), sorted(p.name for p in out.iterdir())
