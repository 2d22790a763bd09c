"""Judging a canary step from the router's metrics: its per-version call counters and latency
histograms read from the metrics text, the calls and the P99 of a version between two
snapshots, and the verdict against the rollout's thresholds (ops/rollout.py runs the steps)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ops.rollout import Thresholds

LATENCY_METRIC = "canary_encoder_call_ms"  # = python_backends.routing.router.LATENCY_METRIC
CALLS_METRIC = "canary_encoder_calls_total"  # = python_backends.routing.router.CALLS_METRIC
# The router adds up its calls in the process and flushes them to the metrics port every
# 0.5 s (python_backends.routing.router.FLUSH_INTERVAL_S): a read right at a step's end misses
# up to that much of its traffic, so the final read of a step waits past it.
FLUSH_WAIT_S = 1.0
_BUCKET = re.compile(r"^(\w+)_bucket\{([^}]*)\}\s+(\S+)", re.M)
_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\}\s+(\S+)", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def call_counts(metrics_text: str, model: str, metric: str = CALLS_METRIC) -> dict[tuple[int, str, str], float]:
    """The router's call counters for ``model``: {(version, router instance, result): count}."""
    out = {}
    for name, labels, value in _SAMPLE.findall(metrics_text):
        if name != metric:
            continue
        tags = dict(_LABEL.findall(labels))
        if tags.get("model") == model and "version" in tags:
            out[(int(tags["version"]), tags.get("instance", ""), tags.get("result", ""))] = float(value)
    return out


def calls_between(before: dict, after: dict, version: int) -> tuple[int, int]:
    """(ok, error) calls of ``version`` between two ``call_counts`` snapshots (per-series deltas:
    a reloaded router's new series count whole)."""
    totals = {"ok": 0.0, "error": 0.0}
    for (v, instance, result), count in after.items():
        if v == version and result in totals:
            totals[result] += count - before.get((v, instance, result), 0.0)
    return int(totals["ok"]), int(totals["error"])


def latency_buckets(metrics_text: str, model: str, metric: str = LATENCY_METRIC) -> dict[tuple[int, str], dict[float, float]]:
    """The router's latency histograms for ``model``: {(version, router instance): {le: cumulative count}}."""
    out: dict[tuple[int, str], dict[float, float]] = {}
    for name, labels, value in _BUCKET.findall(metrics_text):
        if name != metric:
            continue
        tags = dict(_LABEL.findall(labels))
        if tags.get("model") != model or "version" not in tags:
            continue
        le = math.inf if tags.get("le") in ("+Inf", "inf") else float(tags.get("le", "nan"))
        out.setdefault((int(tags["version"]), tags.get("instance", "")), {})[le] = float(value)
    return out


def p99_between(before: dict, after: dict, version: int, quantile: float = 0.99) -> tuple[float | None, int]:
    """(P99 in ms, observations) of ``version`` between two ``latency_buckets`` snapshots,
    summed over router instances: a series is one router process (reloads start new ones), so
    a series only in ``after`` counts whole and one that went away is ignored. The result is
    the upper bound of the bucket holding the quantile (Prometheus' histogram_quantile without
    interpolation)."""
    delta: dict[float, float] = {}
    for (v, instance), buckets in after.items():
        if v != version:
            continue
        old = before.get((v, instance), {})
        for le, count in buckets.items():
            delta[le] = delta.get(le, 0.0) + count - old.get(le, 0.0)
    total = delta.get(math.inf, max(delta.values(), default=0.0))
    if total <= 0:
        return None, 0
    finite = [le for le in sorted(delta) if le != math.inf]
    for le in finite:
        if delta[le] >= quantile * total:
            return le, int(total)
    return (finite[-1] if finite else None), int(total)


@dataclass
class Verdict:
    ok: bool
    judged: bool
    reason: str
    figures: dict


def judge(
    ok_n: int,
    fail_n: int,
    candidate: int,
    stable_p99_ms: float | None,
    candidate_p99_ms: float | None,
    thresholds: Thresholds,
    final: bool,
) -> Verdict:
    """One check of the canary from its encoder calls in the step so far (succeeded, failed).
    The error rate is judged as soon as enough calls were seen; the P99 only at the end of a
    step (``final``), when the window holds the step's traffic."""
    total = ok_n + fail_n
    figures = {
        "calls": int(total),
        "failed": int(fail_n),
        "error_rate": round(fail_n / total, 4) if total else None,
        "p99_ms": None if candidate_p99_ms is None else round(candidate_p99_ms, 2),
        "stable_p99_ms": None if stable_p99_ms is None else round(stable_p99_ms, 2),
    }
    if total < thresholds.min_requests:
        return Verdict(
            True, False, f"{int(total)} calls of version {candidate}, fewer than {thresholds.min_requests}: not judged", figures
        )
    rate = fail_n / total
    if rate > thresholds.max_error_rate:
        return Verdict(
            False,
            True,
            f"version {candidate} error rate {rate:.1%} ({int(fail_n)} of {int(total)}) > {thresholds.max_error_rate:.1%}",
            figures,
        )
    if final and candidate_p99_ms is not None and stable_p99_ms is not None:
        limit = max(stable_p99_ms * thresholds.p99_ratio, stable_p99_ms + thresholds.p99_slack_ms)
        if candidate_p99_ms > limit:
            return Verdict(
                False,
                True,
                f"version {candidate} P99 {candidate_p99_ms:.1f} ms > {limit:.1f} ms "
                f"(stable P99 {stable_p99_ms:.1f} ms x {thresholds.p99_ratio} or "
                f"+ {thresholds.p99_slack_ms:.0f} ms)",
                figures,
            )
    return Verdict(True, True, "ok", figures)
