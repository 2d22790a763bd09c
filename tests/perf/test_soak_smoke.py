"""A 60 s run of perf.drills.soak (sampling every 10 s): it passes its own checks and writes every file.

It starts its own deployment (tritonserver behind the front door, Redis when installed, the
gateway), measures the mix's peak for 5 s and soaks at 0.7 of it. A minute cannot tell a P99
trend from a noisy neighbour (three or four intervals after the warm-up), so this run allows
a P99 rise of 3 x the median instead of 1 x; errors and RSS growth are checked as in
`make soak`.
"""

from __future__ import annotations

import csv
import shutil

import pytest

from perf.drills import soak

pytestmark = pytest.mark.perf


def test_one_minute_soak_passes_and_writes_its_files(tmp_path):
    out = tmp_path / "soak"
    code = soak.main(["--duration", "60", "--peak-seconds", "5", "--p99-growth", "3", "--out", str(out)])
    summary = (out / "summary.md").read_text() if (out / "summary.md").is_file() else "(no summary)"
    assert code == 0, summary
    assert "**Result: passed**" in summary

    samples = list(csv.DictReader((out / "samples.csv").open()))
    groups = {s["group"] for s in samples}
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
    assert expected <= groups, sorted(expected - groups)
    # Every process sampled at 0, 10, ..., 60 s, with its RSS and (after the first) its CPU.
    by_process: dict[str, list[dict]] = {}
    for s in samples:
        by_process.setdefault(s["process"], []).append(s)
    for name, rows in by_process.items():
        assert [float(r["time_s"]) // 10 for r in rows] == [0, 1, 2, 3, 4, 5, 6], (name, [r["time_s"] for r in rows])
        assert all(float(r["rss_mib"]) > 1 for r in rows), name
        assert all(float(r["cpu_cores"]) >= 0 for r in rows[1:]), name

    latency = list(csv.DictReader((out / "latency.csv").open()))
    workloads = {r["workload"] for r in latency}
    assert set(soak.DEFAULT_MIX) <= workloads, workloads
    assert {"generation_ttft", "gateway_chat_ttft"} <= workloads, workloads
    assert all(int(r["errors"]) == 0 for r in latency)
    cancelled = sum(int(r["cancelled"]) for r in latency if r["workload"] in ("generation", "gateway_chat"))
    assert cancelled > 0, "no stream was cancelled"
    for r in latency:
        if r["p99_ms"]:
            assert float(r["max_ms"]) >= float(r["p99_ms"]) >= float(r["p50_ms"]) > 0, r

    png = (out / "soak.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (out / "tritonserver.log").is_file() and (out / "gateway.log").is_file()
