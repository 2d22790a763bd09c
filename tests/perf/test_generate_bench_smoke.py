"""A --quick run of perf.bench.generate_bench: every system streams tokens in one run and the report is complete.

It starts its own servers (a tritonserver with text_generation only, an OpenAI gateway on it,
llama.cpp's llama-server on the peers' Q4_0 GGUF), an in-process engine and OpenVINO
GenAI's pipeline in process, and checks the structure of what the run wrote and that
every system produced tokens, never the figures' size: these machines are small and shared.
"""

from __future__ import annotations

import csv

import pytest

from perf.bench import generate_bench

pytestmark = pytest.mark.perf

SYSTEMS = {"engine", "grpc", "http", "gateway", "llama", "openvino"}


def test_quick_generate_bench_streams_from_every_system(tmp_path):
    if not (generate_bench.DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        pytest.fail("text_generation is not exported: run python -m export (make test does)", pytrace=False)
    code = generate_bench.main(["--quick", "--out-dir", str(tmp_path)])
    summary = (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").is_file() else "(no summary.md)"
    assert code == 0, summary

    with (tmp_path / "cells.csv").open() as f:
        cells = list(csv.DictReader(f))
    assert {(c["system"], int(c["concurrency"])) for c in cells} == {(s, n) for s in SYSTEMS for n in (1, 4)}, summary
    for c in cells:
        where = f"{c['system']} c{c['concurrency']}: {c['first_error']}"
        assert int(c["output_tokens"]) > 0 and float(c["tokens_per_s"]) > 0, where
        assert int(c["errors"]) == 0, where
        assert float(c["ttft_max_ms"]) >= float(c["ttft_p99_ms"]) >= float(c["ttft_p50_ms"]) > 0, where
        assert float(c["itl_max_ms"]) >= float(c["itl_p99_ms"]) >= float(c["itl_p50_ms"]) > 0, where
    # Every finished request made exactly max_tokens tokens (ignore_eos), whichever system served it.
    with (tmp_path / "requests.csv").open() as f:
        finished = [r for r in csv.DictReader(f) if r["finished"] == "True"]
    assert finished and {int(r["tokens"]) for r in finished} == {16}, finished[:5]

    with (tmp_path / "ratios.csv").open() as f:
        ratios = {r["name"]: r for r in csv.DictReader(f)}
    for name in (
        "Triton grpc / engine tokens/s, 4 streams",
        "Triton http / engine tokens/s, 4 streams",
        "Triton grpc / llama.cpp tokens/s, 4 streams",
        "Triton grpc / OpenVINO GenAI tokens/s, 4 streams",
        "gateway / Triton grpc tokens/s, 4 streams",
    ):
        assert float(ratios[name]["value"]) > 0, (name, ratios.get(name))
    assert ratios["gateway - Triton grpc TTFT P50, 4 streams"]["value"] != "", ratios
    assert "| ratio | value | target | met | from |" in summary
    for log in ("tritonserver.log", "gateway-gateway.log", "llama_server.log"):
        assert (tmp_path / log).is_file(), log
