"""A --quick --profile run of perf.bench.generate_bench on the precision `auto` serves: the step's time split
is written for decode-only steps and for the served workload's steady state, and its parts add up to the
step (torch's ops, or the OpenVINO runtime's own node counters, split the forward pass)."""

from __future__ import annotations

import csv

import pytest

from perf.bench import generate_bench
from python_backends.generation.llama_cpp_runtime import LLAMA_PRECISIONS

pytestmark = pytest.mark.perf


def test_quick_profile_splits_decode_and_steady_steps(tmp_path):
    if not (generate_bench.DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        pytest.fail("text_generation is not exported: run python -m export (make test does)", pytrace=False)
    _, served = generate_bench.resolve_precision(generate_bench.ROOT / "model_repository", "auto")
    runtime_split = served not in LLAMA_PRECISIONS
    assert generate_bench.main(["--profile", "--quick", "--concurrency", "4", "--out-dir", str(tmp_path)]) == 0
    with (tmp_path / "profile.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], int(r["batch"])) for r in rows] == [("decode", 1), ("decode", 4), ("steady", 4)]
    for r in rows:
        step = float(r["step_ms"])
        assert step > 0 and float(r["runner_ms"]) > 0, r
        if runtime_split:  # torch's ops, or OpenVINO's own node counters
            parts = sum(float(r[k]) for k in ("matrix_ms", "attention_ms", "other_ops_ms", "outside_ops_ms"))
            assert float(r["matrix_ms"]) > 0 and float(r["attention_ms"]) > 0, r
        else:  # llama.cpp: its forward pass is one call
            assert r["matrix_ms"] == r["attention_ms"] == r["other_ops_ms"] == "", r
            parts = float(r["runner_ms"]) + float(r["outside_ops_ms"])
        assert parts == pytest.approx(step, rel=0.02, abs=0.05), r
        assert int(r["max_context"]) >= int(r["mean_context"]) > 0, r
    # the steady state runs the whole prompt set: its contexts outgrow the decode-only run's short prompts
    assert int(rows[2]["max_context"]) > int(rows[1]["max_context"]), rows
