"""The router's decisions, without Triton: which version serves each request, how requests are
grouped into encoder calls, and where a failed call goes instead.

Request parameters (KServe v2 ``parameters``, forwarded by the ensemble to its steps):

- ``encoder_version`` (int, or a string of one): pin the version; it must be one of the
  router's versions (weights, any percent) or ready, else the request fails with INVALID_ARG;
  a pinned request is never moved to another version.
- ``routing_key`` (string): the sticky key; without it the request id is the key; without
  either the choice is random by the weights.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.errors import ConfigError, InputError
from contract.model_config import ModelConfig
from python_backends.routing.weights import choose_version, format_weights, parse_weights

log = logging.getLogger(__name__)

# What the router exports on the metrics port, per encoder version and router process (labels
# model, version, instance): the rollout judges a canary by these. Triton's own statistics
# count a Python model's error responses as successes, and its per-version latency summary
# includes the warmup samples of a freshly loaded version, which dominate its P99 for minutes.
#  - CALLS_METRIC{result="ok"|"error"|"rejected"}: REQUESTS by where they ended (a call of n
#    requests adds n; see python_backends/routing/serving.py): served by the version, failed
#    by it, or refused as invalid input by every version they were tried on (not the version's
#    fault);
#  - LATENCY_METRIC_bucket{le=...}: successful calls at most ``le`` ms long, cumulative like a
#    Prometheus histogram's buckets, but a COUNTER family: the router adds up its calls and
#    flushes every FLUSH_INTERVAL_S, because each metric update is a round trip to the server
#    process (one per call measured about 10 % of the throughput at concurrency 16).
CALLS_METRIC = "canary_encoder_calls_total"
LATENCY_METRIC = "canary_encoder_call_ms"
LATENCY_BUCKETS_MS = (
    1.0,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    50.0,
    75.0,
    100.0,
    150.0,
    200.0,
    300.0,
    500.0,
    750.0,
    1000.0,
    2000.0,
    5000.0,
)
FLUSH_INTERVAL_S = 0.5


class CallTally:
    """Requests (by result) and call latencies counted in the process between flushes."""

    def __init__(self, interval_s: float = FLUSH_INTERVAL_S, clock=time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self._last = clock()
        self._results: dict = {}  # (version, result) -> requests
        self._buckets: dict = {}  # (version, le label) -> calls (cumulative over le)

    def record(self, version: int, result: str, ms: float | None = None, requests: int = 1) -> None:
        """``requests`` requests of ``version`` ended with ``result`` ("ok", "error", "rejected");
        ``ms``: the duration of the one successful call that served them (a latency sample)."""
        if requests > 0:
            key = (version, result)
            self._results[key] = self._results.get(key, 0) + requests
        if ms is not None:
            for bound in LATENCY_BUCKETS_MS:
                if ms <= bound:
                    self._buckets[(version, f"{bound:g}")] = self._buckets.get((version, f"{bound:g}"), 0) + 1
            self._buckets[(version, "+Inf")] = self._buckets.get((version, "+Inf"), 0) + 1

    def due(self) -> bool:
        return bool(self._results) and self.clock() - self._last >= self.interval_s

    def drain(self) -> tuple[dict, dict]:
        """({(version, result): n}, {(version, le): n}) since the last drain."""
        results, buckets = self._results, self._buckets
        self._results, self._buckets, self._last = {}, {}, self.clock()
        return results, buckets


PIN_PARAMETER = "encoder_version"
KEY_PARAMETER = "routing_key"


@dataclass(frozen=True)
class Decision:
    version: int
    pinned: bool


@dataclass(frozen=True)
class RouterSettings:
    encoder: str
    weights: dict
    fallback_on_error: bool
    versions_on_disk: tuple

    @classmethod
    def from_config(cls, config: ModelConfig, repository: Path) -> RouterSettings:
        """Read and check the router's ``parameters``; ``repository`` holds the encoder's folder."""
        encoder = config.param("encoder_model") or "text_encoder"
        weights = parse_weights(config.param("weights") or "", field=f"model {config.name!r}: parameter 'weights'")
        on_disk = versions_on_disk(Path(repository) / encoder)
        missing = [v for v, w in weights.items() if v not in on_disk]
        if missing:
            raise ConfigError(
                f"model {config.name!r}: parameter 'weights' names version {missing[0]} of {encoder!r}, which has no "
                f"folder {encoder}/{missing[0]} in the model repository (versions there: "
                f"{', '.join(map(str, on_disk)) or 'none'})"
            )
        return cls(encoder, weights, config.param_bool("fallback_on_error", True), tuple(on_disk))


def versions_on_disk(model_dir: Path) -> list[int]:
    """Numeric version folders of a model, ascending."""
    try:
        return sorted(int(p.name) for p in Path(model_dir).iterdir() if p.is_dir() and p.name.isdigit())
    except OSError:
        return []


def parse_parameters(raw: Any) -> dict:
    """A request's parameters as a dict (the python backend hands over a JSON string)."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def decide(
    weights: Mapping[int, int], parameters: Mapping[str, Any], request_id: str = "", known_versions: Iterable[int] = ()
) -> Decision:
    """The version for one request (see the module docstring for the parameters)."""
    pin = parameters.get(PIN_PARAMETER)
    if pin is not None and pin != "":
        try:
            version = int(pin)
        except (TypeError, ValueError):
            raise InputError(PIN_PARAMETER, f"must be an integer version, got {pin!r}") from None
        allowed = sorted(set(weights) | set(known_versions))
        if version not in allowed:
            raise InputError(PIN_PARAMETER, f"version {version} is not served; versions: {', '.join(map(str, allowed))}")
        return Decision(version, True)
    key = parameters.get(KEY_PARAMETER)
    key = str(key) if key not in (None, "") else (request_id or None)
    return Decision(choose_version(weights, key), False)


def group_by(decisions: Sequence[tuple[int, Decision, int]]) -> dict[tuple[int, int, bool], list[int]]:
    """``[(request index, decision, padded length)]`` -> ``{(version, length, pinned): [indices]}``:
    each group is one encoder call (only equal lengths concatenate; pinned requests never
    share a call with ones that may fall back)."""
    groups: dict[tuple[int, int, bool], list[int]] = {}
    for index, decision, length in decisions:
        groups.setdefault((decision.version, length, decision.pinned), []).append(index)
    return groups


def fallback_versions(weights: Mapping[int, int], failed: int, ready: Sequence[int]) -> list[int]:
    """Where an unpinned group goes when ``failed`` errored or is not loaded: the other versions
    by descending weight (the stable one first), then any other ready version, newest first."""
    order = [v for v in sorted(weights, key=lambda v: (-weights[v], -v)) if v != failed]
    order += [v for v in sorted(ready, reverse=True) if v != failed and v not in order]
    return order


class RateLimitedLog:
    """At most one warning per ``interval_s`` (a broken canary would otherwise flood the log)."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._last = float("-inf")
        self._suppressed = 0

    def warn(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            if self._suppressed:
                message += f" ({self._suppressed} similar since the last warning)"
            log.warning(message, *args)
            self._last, self._suppressed = now, 0
        else:
            self._suppressed += 1


def describe(settings: RouterSettings) -> str:
    return f"routes {settings.encoder} by weights {format_weights(settings.weights)}" + (
        "; an unpinned request whose version fails is retried on the stable version" if settings.fallback_on_error else ""
    )
