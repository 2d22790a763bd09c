"""The padding and batch-size metrics' arithmetic (python_backends.padding_metrics): real and
padded tokens of the tokenizer's tensors and of the encoder's real ONNX Runtime runs, the
histogram's cumulative buckets, at most one Metric call per metric and execution, and the
reporter thread that makes them off the execution's path.

``pb_utils`` only exists inside Triton; the recorder below stands in for its MetricFamily and
counts the calls (each one is an IPC round trip there). The real metrics port is checked by
tests/integration/test_metrics.py."""

from __future__ import annotations

import numpy as np
import pytest

from export.reference import model_dir
from python_backends.onnx_engine.batching import TokenBudget, run_batched
from python_backends.padding_metrics import (
    BATCH_SIZE,
    BATCH_SIZE_BUCKETS,
    PADDED_TOKENS,
    REAL_TOKENS,
    PaddingMetrics,
    RunTally,
    batches_counts,
    histogram_buckets,
    mask_counts,
)
from python_backends.text.tokenization import BatchTokenizer

NAMES = ["input_ids", "attention_mask"]


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    calls: list = []

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' spelling
        assert (buckets is not None) == (self.kind == self.HISTOGRAM)
        return FakeMetric(self.name, labels, buckets)


class FakeMetric:
    def __init__(self, name, labels, buckets):
        self.name, self.labels, self.buckets = name, labels, buckets

    def increment(self, value):
        FakeMetricFamily.calls.append((self.name, "increment", value))

    def observe(self, value):
        FakeMetricFamily.calls.append((self.name, "observe", value))


class FakePbUtils:
    MetricFamily = FakeMetricFamily


@pytest.fixture
def calls():
    FakeMetricFamily.calls = []
    return FakeMetricFamily.calls


def request(*lengths: int, width: int) -> dict[str, np.ndarray]:
    ids = np.zeros((len(lengths), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    for k, n in enumerate(lengths):
        ids[k, :n] = np.arange(1, n + 1)
        mask[k, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def test_mask_counts():
    assert mask_counts(request(3, 16, 1, width=16)["attention_mask"]) == (20, 48)
    assert mask_counts(np.zeros((0, 16), dtype=np.int64)) == (0, 0)


def test_tokenizer_batches_count_the_bucketed_padding():
    tok = BatchTokenizer(model_dir() / "tokenizer.json", max_length=256, buckets=(16, 32, 64, 128, 256))
    texts = ["hello world", "a somewhat longer sentence about the weather in spring", "x"]
    batch = tok.encode(texts)
    spans = [(0, 1), (1, 3)]
    encoded = tok.encode_requests(texts, spans)
    real, padded = batches_counts(encoded)
    assert real == int(batch.attention_mask.sum()) == int(batch.lengths.sum())
    assert padded == 3 * batch.input_ids.shape[1] == 3 * 16  # the longest text rounded up to the 16 bucket
    assert real < padded
    assert batches_counts([encoded[0], ValueError("failed request")]) == (int(encoded[0].lengths.sum()), 16)


def test_run_tally_counts_the_runs_after_trimming_and_grouping():
    # Both requests padded to 32 by the tokenizer (4 x 32 = 128 tokens sent); the ragged path
    # trims each row and runs 12, 10 and 5 together at width 12 (padding <= 8), 3 alone: 2 runs.
    feeds = [request(12, 5, width=32), request(10, 3, width=32)]
    tally = RunTally("attention_mask")
    seen = []

    def run(feed):
        seen.append(feed["attention_mask"].shape)
        return {"out": feed["input_ids"].sum(axis=1, keepdims=True).astype(np.float32)}

    outcomes = run_batched(feeds, NAMES, tally.wrap(run), TokenBudget(128, max_padding=8))
    assert all(o.error is None for o in outcomes)
    assert sorted(seen) == [(1, 3), (3, 12)]
    assert tally.take() == (30, 3 * 12 + 3, 2)  # against 4 x 32 = 128 sent
    assert tally.take() == (0, 0, 0)  # take resets


def test_run_tally_skips_failed_runs_and_counts_the_reruns():
    feeds = [request(4, width=16), request(4, width=16)]
    feeds[1]["input_ids"][0, 0] = 10_000  # the run with it fails; each request is rerun alone
    tally = RunTally()

    def run(feed):
        if (feed["input_ids"] >= 10_000).any():
            raise ValueError("id out of range")
        return {"out": np.zeros((feed["input_ids"].shape[0], 1), np.float32)}

    outcomes = run_batched(feeds, NAMES, tally.wrap(run), TokenBudget(128))
    assert outcomes[0].error is None and outcomes[1].error is not None
    assert tally.take() == (4, 4, 1)  # only the successful rerun of the good request


def test_histogram_buckets_are_cumulative():
    got = histogram_buckets([1, 1, 3, 64, 17])
    assert list(got) == [str(b) for b in BATCH_SIZE_BUCKETS] + ["+Inf"]
    assert got == {"1": 2, "2": 2, "4": 3, "8": 3, "16": 3, "32": 4, "64": 5, "+Inf": 5}
    values = list(got.values())
    assert values == sorted(values)


def test_one_call_per_metric_and_execution_and_zeros_not_sent(calls):
    metrics = PaddingMetrics(FakePbUtils, "text_tokenizer", "1", batch_histogram=True, background=False)
    assert metrics.batch_size.buckets == list(BATCH_SIZE_BUCKETS)
    assert metrics.real.labels == {"model": "text_tokenizer", "version": "1"}
    metrics.record(20, 48, requests=5)
    assert calls == [(REAL_TOKENS, "increment", 20), (PADDED_TOKENS, "increment", 48), (BATCH_SIZE, "observe", 5)]
    calls.clear()
    metrics.record(0, 0, requests=2)  # every request of the execution was refused
    assert calls == [(BATCH_SIZE, "observe", 2)]
    assert len(metrics.objects()) == 6  # 3 metrics + 3 families, for keep_metrics


def test_encoder_metrics_have_no_histogram_and_failures_do_not_raise(calls):
    metrics = PaddingMetrics(FakePbUtils, "text_encoder", "1", background=False)
    metrics.record(30, 34)
    assert calls == [(REAL_TOKENS, "increment", 30), (PADDED_TOKENS, "increment", 34)]
    assert len(metrics.objects()) == 4

    def broken(value):
        raise RuntimeError("the IPC message queue is gone")

    metrics.real.increment = broken
    metrics.record(1, 1)  # logged, not raised: the batch's responses still go out


def test_background_reporter_sums_the_counters_and_observes_every_execution(calls):
    metrics = PaddingMetrics(FakePbUtils, "text_tokenizer", "1", batch_histogram=True)
    for n in range(1, 51):
        metrics.record(10 * n, 16 * n, requests=n)
    metrics.close()
    assert not metrics._thread.is_alive()
    increments = [c for c in calls if c[1] == "increment"]
    assert sum(v for name, _, v in increments if name == REAL_TOKENS) == 10 * 1275
    assert sum(v for name, _, v in increments if name == PADDED_TOKENS) == 16 * 1275
    assert len(increments) <= 2 * 50  # executions queued meanwhile share one increment
    assert [v for name, kind, v in calls if kind == "observe"] == list(range(1, 51))
    metrics.close()  # twice is harmless
