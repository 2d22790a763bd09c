"""How much of what the encoder computes is real text: padding and batch-size metrics.

Two steps report, under the same metric names, each labelled ``model`` (the Triton model
name) and ``version``:

- ``embedding_padding_real_tokens_total`` and ``embedding_padding_padded_tokens_total``
  (counters): attention-mask ones, and rows x padded length. The tokenizer reports the
  tensors it hands on (model="text_tokenizer": its bucketed padding); the local Python-based
  onnxruntime backend reports the ONNX Runtime runs it really made after trimming and
  regrouping the rows under ``max_batch_tokens`` (model="text_encoder",
  "text_encoder_interactive"). Fill rate = rate(real) / rate(padded).
- ``embedding_tokenizer_batch_size`` (histogram, tokenizer only): requests per execution;
  its ``_count`` is the tokenizer's executions.

Cost: every ``pb_utils`` Metric call is a round trip from the stub to the Triton process, so
an execution only queues its figures (never one call per row); a reporter thread sums the
counters of the executions queued meanwhile into one increment each and observes each
execution once in the histogram; counts of zero are not sent. The arithmetic is here;
``pb_utils`` is passed in, as in ``python_backends.shim``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

REAL_TOKENS = "embedding_padding_real_tokens_total"
PADDED_TOKENS = "embedding_padding_padded_tokens_total"
BATCH_SIZE = "embedding_tokenizer_batch_size"
# Requests per tokenizer execution: powers of two up to the models' max_batch_size (64).
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

log = logging.getLogger(__name__)

DESCRIPTIONS = {
    REAL_TOKENS: "Real tokens (attention-mask ones) in the tensors sent to or run by the encoder",
    PADDED_TOKENS: "Padded tokens (rows x padded length) in the tensors sent to or run by the encoder",
    BATCH_SIZE: "Requests per tokenizer execution",
}


def mask_counts(mask: np.ndarray) -> tuple[int, int]:
    """(real, padded) tokens of one [rows, length] attention mask: its nonzero entries, its size."""
    mask = np.asarray(mask)
    return int(np.count_nonzero(mask)), int(mask.size)


def batches_counts(batches: Iterable[Any]) -> tuple[int, int]:
    """(real, padded) summed over encoded batches (anything with ``lengths`` and ``input_ids``,
    e.g. python_backends.text.tokenization.EncodedBatch); exceptions in the list (requests that
    failed) are skipped. One numpy reduction for all of them: a sum per batch cost about 7 us
    per request, a tenth of tokenizing it."""
    ok = [batch for batch in batches if not isinstance(batch, BaseException)]
    if not ok:
        return 0, 0
    padded = sum(batch.input_ids.size for batch in ok)
    real = int(np.concatenate([batch.lengths for batch in ok]).sum()) if len(ok) > 1 else int(ok[0].lengths.sum())
    return real, padded


class RunTally:
    """Counts the real and padded tokens of the runs a model really made: ``wrap(run)`` returns
    a run function that, after each successful call, adds ``mask_counts`` of its feed's
    ``length_input``. ``take()`` returns (real, padded, runs) since the last take."""

    def __init__(self, length_input: str = "attention_mask"):
        self.length_input = length_input
        self.real = self.padded = self.runs = 0

    def wrap(self, run: Callable[[dict], Any]) -> Callable[[dict], Any]:
        def counted(feed: dict) -> Any:
            out = run(feed)
            mask = feed.get(self.length_input)
            if mask is not None:
                real, padded = mask_counts(mask)
                self.real += real
                self.padded += padded
                self.runs += 1
            return out

        return counted

    def take(self) -> tuple[int, int, int]:
        counts = (self.real, self.padded, self.runs)
        self.real = self.padded = self.runs = 0
        return counts


def histogram_buckets(values: Iterable[float], buckets: Iterable[float] = BATCH_SIZE_BUCKETS) -> dict[str, int]:
    """Cumulative bucket counts of ``values`` as a Prometheus histogram exposes them
    ({le: count}, "+Inf" last): what a scrape of ``embedding_tokenizer_batch_size`` must show
    for the executions it observed."""
    values = list(values)
    out = {_le(b): sum(1 for v in values if v <= b) for b in sorted(buckets)}
    out["+Inf"] = len(values)
    return out


def _le(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


class PaddingMetrics:
    """The padding counters (and, with ``batch_histogram``, the batch-size histogram) of one
    model instance. Keep it for the process's life; in ``finalize`` call ``close()`` and hand
    ``objects()`` to ``python_backends.shim.keep_metrics``.

    With ``background`` (the default) ``record`` only queues the execution's figures and one
    reporter thread makes the Metric calls, summing the counters of every execution queued
    meanwhile into one increment each: the IPC round trips (about 60 us each, measured by
    perf/bench/overhead.py) stay off the execution's path. Without it, ``record`` calls at once."""

    def __init__(self, pb_utils: Any, model: str, version: str, batch_histogram: bool = False, background: bool = True):
        family = pb_utils.MetricFamily
        labels = {"model": model, "version": str(version)}
        # A MetricFamily must outlive its Metric objects: kept on self.
        self._families = [
            family(name=REAL_TOKENS, description=DESCRIPTIONS[REAL_TOKENS], kind=family.COUNTER),
            family(name=PADDED_TOKENS, description=DESCRIPTIONS[PADDED_TOKENS], kind=family.COUNTER),
        ]
        self.real = self._families[0].Metric(labels=labels)
        self.padded = self._families[1].Metric(labels=labels)
        self.batch_size = None
        if batch_histogram:
            # python_backend r24.10 has MetricFamily.HISTOGRAM (added upstream in August 2024).
            self._families.append(family(name=BATCH_SIZE, description=DESCRIPTIONS[BATCH_SIZE], kind=family.HISTOGRAM))
            self.batch_size = self._families[-1].Metric(labels=labels, buckets=list(BATCH_SIZE_BUCKETS))
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._report, name=f"padding-metrics-{model}", daemon=True)
            self._thread.start()

    def record(self, real: int, padded: int, requests: int | None = None) -> None:
        """One execution: ``real`` and ``padded`` tokens; ``requests`` observed in the histogram.
        A failure is logged, never raised: metrics must not fail the batch's responses."""
        if self._queue is not None:
            self._queue.put((real, padded, requests))
        else:
            self._send(real, padded, [] if requests is None else [requests])

    def _send(self, real: int, padded: int, observations: list) -> None:
        try:
            if real:
                self.real.increment(real)
            if padded:
                self.padded.increment(padded)
            if self.batch_size is not None:
                for n in observations:
                    self.batch_size.observe(n)
        except Exception:  # noqa: BLE001
            log.exception("recording the padding metrics failed")

    def _report(self) -> None:
        assert self._queue is not None
        while True:
            items = [self._queue.get()]
            while True:  # everything queued meanwhile goes out in one set of calls
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in items
            items = [item for item in items if item is not None]
            self._send(sum(i[0] for i in items), sum(i[1] for i in items), [i[2] for i in items if i[2] is not None])
            if stop:
                return

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued and stop the reporter thread."""
        if self._queue is not None and self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def objects(self) -> list:
        metrics = [self.real, self.padded] + ([self.batch_size] if self.batch_size is not None else [])
        return metrics + list(self._families)
