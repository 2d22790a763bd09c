"""The generation engine's metrics on Triton's metrics port (``pb_utils.MetricFamily``).

Names follow vLLM's (``vllm:<name>`` there, ``llm_<name>`` here), all labelled
``model`` (and ``version``):

- histograms ``llm_time_to_first_token_seconds``, ``llm_time_per_output_token_seconds``
  (each interval between two tokens of a stream) and ``llm_e2e_request_latency_seconds``;
- counters ``llm_prompt_tokens_total``, ``llm_generation_tokens_total``,
  ``llm_request_success_total{finish_reason}``, ``llm_prefix_cache_queries_total`` and
  ``llm_prefix_cache_hits_total`` (tokens), ``llm_num_preemptions_total``,
  ``llm_spec_decode_num_draft_tokens_total`` and ``llm_spec_decode_num_accepted_tokens_total``
  (prompt-lookup drafts proposed and accepted), ``llm_prompt_tokens_computed_total`` (prompt
  tokens the model ran: prefix-cache hits and forked choices not counted) and
  ``llm_sequences_forked_total`` (choices of ``n`` > 1 forked from their prompt's sequence);
- gauges ``llm_num_requests_running``, ``llm_num_requests_waiting``,
  ``llm_kv_cache_blocks_used``, ``llm_kv_cache_blocks_total``, and the first two per priority
  class: ``llm_num_requests_running_by_class`` and ``llm_num_requests_waiting_by_class``
  ``{priority_class}``.

Every Metric call is a round trip to the Triton process, so the engine thread only
queues events; one reporter thread makes the calls, and adds a step's generated tokens to
their counter in one call once it has drained the step's outputs.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from contract.sampling import PRIORITY_CLASSES
from python_backends.generation.engine import RequestOutput

log = logging.getLogger(__name__)

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0]
FINISH_REASONS = ("stop", "length", "abort")
STAT_COUNTERS = {
    "prefix_cache_queries": "prefix_queries",
    "prefix_cache_hits": "prefix_hits",
    "num_preemptions": "preemptions",
    "spec_draft_tokens": "spec_draft_tokens",
    "spec_accepted_tokens": "spec_accepted_tokens",
    "prompt_tokens_computed": "prompt_tokens_computed",
    "sequences_forked": "sequences_forked",
}
# Gauges also kept per priority class (the engine's stats <key>_<class>): key -> description.
CLASS_GAUGES = {
    "num_requests_running": "Sequences in the running batch, per priority class",
    "num_requests_waiting": "Requests waiting for admission, per priority class",
}


class GenerationMetrics:
    def __init__(self, pb_utils: Any, labels: dict[str, str], baseline: dict | None = None):
        family = pb_utils.MetricFamily
        self._families: list[Any] = []

        def fam(name, description, kind):
            f = family(name=name, description=description, kind=kind)
            self._families.append(f)
            return f

        self.ttft = fam(
            "llm_time_to_first_token_seconds", "Time from arrival to the first output token", family.HISTOGRAM
        ).Metric(labels=labels, buckets=TTFT_BUCKETS)
        self.tpot = fam(
            "llm_time_per_output_token_seconds", "Interval between two output tokens of one stream", family.HISTOGRAM
        ).Metric(labels=labels, buckets=TPOT_BUCKETS)
        self.e2e = fam("llm_e2e_request_latency_seconds", "Time from arrival to the last output", family.HISTOGRAM).Metric(
            labels=labels, buckets=E2E_BUCKETS
        )
        self.prompt_tokens = fam("llm_prompt_tokens_total", "Prompt tokens of finished requests", family.COUNTER).Metric(
            labels=labels
        )
        self.generation_tokens = fam("llm_generation_tokens_total", "Tokens generated", family.COUNTER).Metric(labels=labels)
        success = fam("llm_request_success_total", "Finished requests by finish reason", family.COUNTER)
        self.success = {r: success.Metric(labels={**labels, "finish_reason": r}) for r in FINISH_REASONS}
        self.counters = {
            "prefix_queries": fam(
                "llm_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache", family.COUNTER
            ).Metric(labels=labels),
            "prefix_hits": fam("llm_prefix_cache_hits_total", "Prompt tokens found in the prefix cache", family.COUNTER).Metric(
                labels=labels
            ),
            "preemptions": fam(
                "llm_num_preemptions_total", "Running sequences preempted (recomputed later)", family.COUNTER
            ).Metric(labels=labels),
            "spec_draft_tokens": fam(
                "llm_spec_decode_num_draft_tokens_total", "Prompt-lookup draft tokens verified", family.COUNTER
            ).Metric(labels=labels),
            "spec_accepted_tokens": fam(
                "llm_spec_decode_num_accepted_tokens_total", "Prompt-lookup draft tokens accepted", family.COUNTER
            ).Metric(labels=labels),
            "prompt_tokens_computed": fam(
                "llm_prompt_tokens_computed_total",
                "Prompt tokens the model ran (prefix-cache hits and forked choices not counted)",
                family.COUNTER,
            ).Metric(labels=labels),
            "sequences_forked": fam(
                "llm_sequences_forked_total", "Choices of n > 1 forked from their prompt's sequence", family.COUNTER
            ).Metric(labels=labels),
        }
        self.gauges = {
            "num_requests_running": fam("llm_num_requests_running", "Sequences in the running batch", family.GAUGE).Metric(
                labels=labels
            ),
            "num_requests_waiting": fam("llm_num_requests_waiting", "Requests waiting for admission", family.GAUGE).Metric(
                labels=labels
            ),
            "kv_blocks_used": fam("llm_kv_cache_blocks_used", "KV cache blocks held by sequences", family.GAUGE).Metric(
                labels=labels
            ),
            "kv_blocks_total": fam("llm_kv_cache_blocks_total", "KV cache blocks in the pool", family.GAUGE).Metric(
                labels=labels
            ),
        }
        for key, description in CLASS_GAUGES.items():
            by_class = fam(f"llm_{key}_by_class", description, family.GAUGE)
            for cls in PRIORITY_CLASSES:
                self.gauges[f"{key}_{cls}"] = by_class.Metric(labels={**labels, "priority_class": cls})
        # Counts already in the engine (its warm-up) are not reported.
        self._seen = {name: int((baseline or {}).get(key, 0)) for key, name in STAT_COUNTERS.items()}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._last_token: dict[Any, float] = {}
        self._unreported_tokens = 0  # generated tokens not yet added to llm_generation_tokens_total
        self._thread = threading.Thread(target=self._report, name="generation-metrics", daemon=True)
        self._thread.start()

    def objects(self) -> list:
        """Every Metric and MetricFamily made here (for ``python_backends.shim.keep_metrics``)."""
        return [
            self.ttft,
            self.tpot,
            self.e2e,
            self.prompt_tokens,
            self.generation_tokens,
            *self.success.values(),
            *self.counters.values(),
            *self.gauges.values(),
            *self._families,
        ]

    # ---- called by the engine loop thread: cheap -------------------------------------
    def on_output(self, out: RequestOutput) -> None:
        self._events.put(("output", out))

    def on_stats(self, stats: dict) -> None:
        self._events.put(("stats", stats))

    def close(self) -> None:
        self._events.put(("stop", None))
        self._thread.join(5.0)

    # ---- reporter thread -----------------------------------------------------------------
    def _report(self) -> None:
        while True:
            if self._unreported_tokens and self._events.empty():  # a step's outputs are in: one call for their tokens
                self._flush_tokens()
            kind, item = self._events.get()
            if kind == "stop":
                self._flush_tokens()
                return
            try:
                if kind == "output":
                    self._record_output(item)
                else:
                    self._record_stats(item)
            except Exception:  # noqa: BLE001 - metrics must never take generation down
                log.exception("recording generation metrics failed")

    def _flush_tokens(self) -> None:
        tokens, self._unreported_tokens = self._unreported_tokens, 0
        if tokens:
            try:
                self.generation_tokens.increment(tokens)
            except Exception:  # noqa: BLE001 - metrics must never take generation down
                log.exception("recording generation metrics failed")

    def _record_output(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None:
            return
        rid = (out.request_id, out.index)  # a stream: one choice of the request
        if out.token_ids:
            self._unreported_tokens += len(out.token_ids)  # one counter call per drained burst (_report)
            previous = self._last_token.get(rid)
            if previous is None and m.first_token is not None:
                self.ttft.observe(m.first_token - m.arrival)
            elif previous is not None and m.last_token is not None and len(out.token_ids):
                gap = (m.last_token - previous) / len(out.token_ids)
                for _ in out.token_ids:
                    self.tpot.observe(gap)
            if m.last_token is not None:
                self._last_token[rid] = m.last_token
        if out.finished:
            self._last_token.pop(rid, None)
        if out.last:  # the request's, once whatever its n
            self._flush_tokens()  # a scrape that sees the request finished sees all its tokens
            self.prompt_tokens.increment(out.num_input_tokens)
            self.success.get(out.finish_reason or "abort", self.success["abort"]).increment(1)
            if m.finished is not None:
                self.e2e.observe(m.finished - m.arrival)

    def _record_stats(self, stats: dict) -> None:
        for key, name in STAT_COUNTERS.items():
            value = int(stats.get(key, 0))
            if value > self._seen[name]:
                self.counters[name].increment(value - self._seen[name])
                self._seen[name] = value
        for key in self.gauges:
            if key in stats:
                self.gauges[key].set(float(stats[key]))
