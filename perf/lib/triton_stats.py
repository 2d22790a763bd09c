"""Per-model figures from Triton's statistics extension, as the difference of two snapshots.

perf_analyzer's report lists an ensemble's composing models, but not the models a Python
step calls through BLS (a router calling the encoder, a cache calling the ensemble). Reading
``GET /v2/models/stats`` before and after a measurement gives every model's share of it:
requests, executions (so the mean batch), and the mean queue and compute times per request.
``metrics`` reads the metrics port's samples.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping

from perf.lib.perf_analyzer import ModelStats

_PHASES = {
    "queue": "queue",
    "compute_input": "compute input",
    "compute_infer": "compute infer",
    "compute_output": "compute output",
    "cache_hit": "cache hit",
    "cache_miss": "cache miss",
}


def snapshot(http_url: str, headers: Mapping[str, str] | None = None, timeout: float = 10.0) -> dict[str, dict]:
    """{model: its cumulative statistics} for every loaded model version (the newest per model)."""
    request = urllib.request.Request(f"http://{http_url}/v2/models/stats", headers=dict(headers or {}))
    with urllib.request.urlopen(request, timeout=timeout) as r:
        body = json.loads(r.read())
    out: dict[str, dict] = {}
    for entry in body.get("model_stats", []):
        name = entry.get("name", "")
        key = f"{name}@{entry.get('version', '')}"
        out[key] = entry
    return out


def _count(stats: Mapping, phase: str) -> int:
    return int(stats.get("inference_stats", {}).get(phase, {}).get("count", 0))


def _ns(stats: Mapping, phase: str) -> int:
    return int(stats.get("inference_stats", {}).get(phase, {}).get("ns", 0))


def delta(before: Mapping[str, dict], after: Mapping[str, dict], skip: tuple[str, ...] = ()) -> dict[str, ModelStats]:
    """What happened between two snapshots, per model that served requests in between.

    Times are means per successful request, in ms; a version loaded in between counts from zero.
    Model names in ``skip`` are left out. Keys are model names, with ``@<version>`` added when
    several versions of one model served requests.
    """
    raw: dict[str, ModelStats] = {}
    for key, now in after.items():
        name, _, version = key.partition("@")
        if name in skip:
            continue
        was = before.get(key, {})
        success = _count(now, "success") - _count(was, "success")
        if success <= 0:
            continue
        parts = {label: (_ns(now, phase) - _ns(was, phase)) / success / 1e6 for phase, label in _PHASES.items()}
        raw[key] = ModelStats(
            name=name,
            version=version,
            inference_count=int(now.get("inference_count", 0)) - int(was.get("inference_count", 0)),
            execution_count=int(now.get("execution_count", 0)) - int(was.get("execution_count", 0)),
            success_count=success,
            avg_request_latency_ms=(_ns(now, "success") - _ns(was, "success")) / success / 1e6,
            breakdown_ms={k: v for k, v in parts.items() if v > 0 or k in ("queue", "compute infer")},
            cache_hit_count=_count(now, "cache_hit") - _count(was, "cache_hit"),
            cache_miss_count=_count(now, "cache_miss") - _count(was, "cache_miss"),
        )
    names = [s.name for s in raw.values()]
    return {(s.name if names.count(s.name) == 1 else key): s for key, s in raw.items()}


def fetch_delta(
    http_url: str, before: Mapping[str, dict], skip: tuple[str, ...] = (), headers: Mapping[str, str] | None = None
) -> dict[str, ModelStats]:
    """delta() against a fresh snapshot; {} when the server cannot be asked (never raises)."""
    try:
        return delta(before, snapshot(http_url, headers), skip)
    except (OSError, ValueError, urllib.error.URLError):
        return {}


def per_request(before: Mapping[str, dict], after: Mapping[str, dict], models: Collection[str] | None = None) -> dict[str, dict]:
    """delta() as the load benchmarks print it, for ``models`` (default all): requests, mean batch
    (inferences per execution), and queue and compute (input + infer + output) ms per request."""
    return {
        name: {
            "requests": s.success_count,
            "batch": round(s.avg_batch, 2) if s.avg_batch is not None else None,
            "queue_ms": round(s.breakdown_ms.get("queue", 0.0), 3),
            "compute_ms": round(sum(v for k, v in s.breakdown_ms.items() if k.startswith("compute")), 3),
        }
        for name, s in delta(before, after).items()
        if models is None or s.name in models
    }


def metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """The samples of a Prometheus text endpoint (Triton's metrics port) as ``name{labels}`` -> value,
    the labels sorted (``nv_cache_num_hits_per_model{model="m",version="1"}``)."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=timeout) as r:
        for line in r.read().decode().splitlines():
            if m := re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line):
                labels = ",".join(sorted(re.findall(r'\w+="[^"]*"', m.group(2) or "")))
                key = f"{m.group(1)}{{{labels}}}"
                out[key] = out.get(key, 0.0) + float(m.group(3))
    return out
