"""perf.limit: what the served config says, and a real (tiny) in-process measurement."""

from __future__ import annotations

import dataclasses

import pytest

from perf import limit

CONFIG = """
instance_group [
  # count: 9 in a comment does not count
  { count: 2 kind: KIND_CPU }
]
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
"""


def test_instance_count_and_threads_come_from_the_config_text():
    assert limit.instance_count(CONFIG) == 2
    assert limit.instance_count('name: "x"') == 1
    assert limit.config_parameter(CONFIG, "intra_op_thread_count") == "1"


def test_layouts_are_the_served_one_and_one_session_over_all_cores(tmp_path):
    served = limit.ServedEncoder("cpu", "cpu", "int8", tmp_path / "m.onnx", threads=1, instances=2)
    assert limit.layouts(served, cores=2) == [(2, 1), (1, 2)]
    assert limit.layouts(dataclasses.replace(served, threads=2, instances=1), cores=2) == [(1, 2)]


def test_measure_runs_both_layouts_and_keeps_the_faster_per_batch():
    served = limit.served_encoder("cpu")
    if not served.model_path.is_file():
        pytest.fail(f"{served.model_path} missing: run `make export` (make test does)", pytrace=False)
    served = dataclasses.replace(served, threads=1, instances=2)
    result = limit.measure(served, limit.load_sentences(), batches=(1, 4), rounds=1, seconds=0.05)
    assert set(result.layouts) == {f"{n}x{t}" for n, t in limit.layouts(served)}
    assert "2x1" in result.layouts
    for b in (1, 4):
        figures = [kinds["encoder"].throughput[b] for kinds in result.layouts.values()]
        assert result.encoder.throughput[b] == max(figures) > 0
    assert result.best_layout() in result.layouts
    assert {r["layout"] for r in result.rows()} == set(result.layouts)
    text = limit.markdown(result)
    assert "served: 2x1" in text and "| best |" in text
