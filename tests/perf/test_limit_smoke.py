"""perf.baselines.limit on the exported encoder: a real (tiny) in-process measurement of both thread layouts.

In the perf tier because it needs `make export`'s output (the unit tier must not).
"""

from __future__ import annotations

import dataclasses

import pytest

from perf.baselines import limit


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
