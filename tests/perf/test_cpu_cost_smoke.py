"""A small run of perf.bench.cpu_cost: every path measured, every process of the deployment a column, sane figures.

It starts its own deployment (tritonserver behind the front door, Redis when installed, the
gateway), sends a few requests per path and checks the table's structure and that each path's
cost falls on the processes that path goes through; never the figures' size, which depends
on the machine.
"""

from __future__ import annotations

import csv
import math
import shutil

import pytest

from perf.bench import cpu_cost

pytestmark = pytest.mark.perf


def test_small_cpu_cost_run_accounts_every_process(tmp_path):
    out = tmp_path / "cpu"
    # Enough work a path for Triton's share to be ticks: /proc counts CPU in 10 ms ticks, and
    # its share of 100 cheap requests (about 20 ms) or 16 tokens rounded to none.
    code = cpu_cost.main(
        [
            "--requests",
            "500",
            "--image-requests",
            "24",
            "--gen-requests",
            "4",
            "--max-tokens",
            "32",
            "--idle-seconds",
            "1",
            "--out",
            str(out),
        ]
    )
    table = (out / "cpu_cost.md").read_text() if (out / "cpu_cost.md").is_file() else "(no table)"
    assert code == 0, table
    rows = list(csv.DictReader((out / "cpu_cost.csv").open()))
    cost = {(r["path"], r["process"]): float(r["net_cpu_s_per_1000"]) for r in rows}
    raw = {(r["path"], r["process"]): float(r["raw_cpu_s"]) for r in rows}
    paths = {p for p, _ in cost}
    groups = {g for _, g in cost}
    assert paths == set(cpu_cost.PATHS), table
    expected = {
        "tritonserver",
        "frontdoor (nginx)",
        "gateway",
        "load generator",
        "stub text_tokenizer",
        "stub text_encoder",
        "stub text_embedding_cached",
        "stub image_preprocess",
        "stub image_classifier",
        "stub image_postprocess",
        "stub text_generation",
    }
    if shutil.which("redis-server"):
        expected.add("redis")
    assert expected <= groups, (sorted(expected - groups), table)
    for (path, group), v in cost.items():
        assert math.isfinite(v) and 0 <= v < 5000, (path, group, v)
    for r in rows:
        assert int(r["errors"]) == 0 and int(r["units"]) > 0, r
        assert float(r["raw_cpu_s"]) >= float(r["net_cpu_s"]) >= 0, r

    def on(path: str) -> dict[str, float]:
        return {g: cost[(path, g)] for g in groups}

    # Each path costs most in the stubs it goes through, and Triton's own threads are on every path.
    # Raw CPU, not net: a one-second idle sample is a tick or two, so subtracting it can zero Triton's
    # share of a short path (64 streamed tokens) while its threads did run.
    for path in cpu_cost.PATHS:
        assert raw[(path, "tritonserver")] > 0 and cost[(path, "load generator")] >= 0, (on(path), table)
    assert cost[("text_encoder", "stub text_encoder")] > cost[("text_encoder", "stub text_tokenizer")], on("text_encoder")
    assert cost[("text_embedding", "stub text_encoder")] > 0 and cost[("text_embedding", "stub text_tokenizer")] > 0, on(
        "text_embedding"
    )
    assert cost[("image_classification", "stub image_classifier")] > cost[("image_classification", "stub text_encoder")]
    assert cost[("text_generation", "stub text_generation")] > cost[("text_generation", "stub text_encoder")]
    assert cost[("gateway_embeddings", "gateway")] > cost[("text_embedding", "gateway")], on("gateway_embeddings")
    # A cache hit skips the encoder: far cheaper than a miss.
    hit = sum(on("text_embedding_cached_hit").values())
    miss = sum(on("text_embedding_cached_miss").values())
    assert hit < miss, (hit, miss, table)
    assert "| path |" in table and "| idle, CPU-s per 1,000 s |" in table
    assert (out / "tritonserver.log").is_file() and (out / "gateway.log").is_file()
