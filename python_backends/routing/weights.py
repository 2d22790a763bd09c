"""Version weights ("1:90,2:10") and the stable-hash choice of a version per routing key.

A key is hashed (BLAKE2b, not Python's salted ``hash``) to one of 10,000 buckets; versions own
consecutive bucket ranges in ascending version order, so the newest version owns the top of
the range. Raising its weight only moves buckets from the older version to it: a key that was
on the canary at 10 % is still on it at 50 % and 100 % (sticky), and for a given split a key
always lands on the same side, in every router process and after every reload.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping

from contract.errors import ConfigError

BUCKETS = 10_000
# Weights are whole percent: 10 -> 50 -> 100 and the rollback are all a rollout needs.
TOTAL = 100


class RoutingError(ConfigError):
    """Weights that cannot be served (they fail the router's load, or the rollout command)."""


def parse_weights(text: str, field: str = "weights") -> dict[int, int]:
    """``"1:90,2:10"`` -> ``{1: 90, 2: 10}``; errors name the field, the entry and the limit."""
    if text is None or not str(text).strip():
        raise RoutingError(f"{field}: empty; expected 'version:percent,...' summing to {TOTAL}, e.g. '1:100'")
    weights: dict[int, int] = {}
    for entry in str(text).replace(" ", "").split(","):
        if not entry:
            continue
        version_s, sep, percent_s = entry.partition(":")
        if not sep:
            raise RoutingError(f"{field}: entry {entry!r} is not 'version:percent'")
        try:
            version, percent = int(version_s), int(percent_s)
        except ValueError:
            raise RoutingError(f"{field}: entry {entry!r} must be two integers 'version:percent'") from None
        if version < 1:
            raise RoutingError(f"{field}: version {version} must be >= 1")
        if version in weights:
            raise RoutingError(f"{field}: version {version} is given twice")
        weights[version] = percent
    return validate_weights(weights, field)


def validate_weights(weights: Mapping[int, int], field: str = "weights") -> dict[int, int]:
    """Check percentages (0..100 each, sum exactly 100, at least one version) and return a sorted copy."""
    if not weights:
        raise RoutingError(f"{field}: no versions; expected 'version:percent,...' summing to {TOTAL}")
    out: dict[int, int] = {}
    for version in sorted(weights):
        percent = weights[version]
        if not isinstance(percent, int) or isinstance(percent, bool):
            raise RoutingError(f"{field}: version {version} has weight {percent!r}; weights are whole percent")
        if not 0 <= percent <= TOTAL:
            raise RoutingError(f"{field}: version {version} has weight {percent}; each weight must be 0..{TOTAL}")
        if int(version) < 1:
            raise RoutingError(f"{field}: version {version} must be >= 1")
        out[int(version)] = percent
    total = sum(out.values())
    if total != TOTAL:
        raise RoutingError(f"{field}: weights sum to {total} ({format_weights(out)}); they must sum to {TOTAL}")
    return out


def format_weights(weights: Mapping[int, int]) -> str:
    """``{1: 90, 2: 10}`` -> ``"1:90,2:10"`` (the router's ``weights`` parameter)."""
    return ",".join(f"{v}:{weights[v]}" for v in sorted(weights))


def route_bucket(key: str | bytes) -> int:
    """The key's bucket in [0, BUCKETS): the same in every process and Python version."""
    data = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") % BUCKETS


def choose_version(weights: Mapping[int, int], key: str | bytes | None = None, rng: random.Random | None = None) -> int:
    """The version that serves a request: by its key's bucket, or at random without a key.

    ``weights`` must be valid (``validate_weights``). Versions with weight 0 never serve.
    """
    bucket = route_bucket(key) if key else (rng or random).randrange(BUCKETS)
    edge = 0
    chosen = None
    for version in sorted(weights):
        if weights[version] <= 0:
            continue
        chosen = version
        edge += weights[version] * (BUCKETS // TOTAL)
        if bucket < edge:
            return version
    if chosen is None:
        raise RoutingError("weights: every version has weight 0")
    return chosen
