"""The router's metrics on Triton's metrics port (``pb_utils.MetricFamily``, passed in as in
``python_backends.shim``): the CallTally's counts per encoder version, flushed in batches
(router.CALLS_METRIC and router.LATENCY_METRIC say what they count)."""

from __future__ import annotations

import os
from typing import Any

from python_backends.routing.router import CALLS_METRIC, LATENCY_METRIC, CallTally


class RouterMetrics:
    def __init__(self, pb_utils: Any, encoder: str, instance_name: str = ""):
        family = pb_utils.MetricFamily
        # Kept: a MetricFamily must outlive its Metric objects, or the next set() fails.
        self.calls = family(
            name=CALLS_METRIC,
            description="Requests the router sent to text_encoder, by version and result (ok, error, rejected)",
            kind=family.COUNTER,
        )
        self.latency = family(
            name=LATENCY_METRIC + "_bucket",
            description="The router's successful text_encoder calls at most le ms long (cumulative buckets)",
            kind=family.COUNTER,
        )
        # One series per router process: a reloaded router starts new ones (ops/rollout.py
        # takes per-series deltas).
        self.base = {"model": encoder, "instance": f"{instance_name}/pid{os.getpid()}"}
        self._metrics: dict = {}

    def _metric(self, family: Any, labels: dict) -> Any:
        key = (family.__class__, id(family), tuple(sorted(labels.items())))
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._metrics[key] = family.Metric(labels=labels)
        return metric

    def flush(self, tally: CallTally) -> None:
        """Add what ``tally`` counted since its last drain."""
        results, buckets = tally.drain()
        for (version, result), n in results.items():
            self._metric(self.calls, {**self.base, "version": str(version), "result": result}).increment(n)
        for (version, le), n in buckets.items():
            self._metric(self.latency, {**self.base, "version": str(version), "le": le}).increment(n)

    def objects(self) -> list:
        """Every Metric and MetricFamily made here (for ``python_backends.shim.keep_metrics``)."""
        return [*self._metrics.values(), self.calls, self.latency]
