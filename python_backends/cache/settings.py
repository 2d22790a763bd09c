"""Cache settings: ``parameters { }`` of the cached model's config.pbtxt, overridable by
environment variables ``EMBEDDING_CACHE_<KEY>`` (e.g. ``EMBEDDING_CACHE_L2_REDIS_URL``), so
one config serves every deployment and each deployment points at its own Redis."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from contract.errors import ConfigError
from contract.model_config import ModelConfig

ENV_PREFIX = "EMBEDDING_CACHE_"

# key -> (default, minimum, description); every value is a number except the URL.
NUMERIC = {
    "l1_max_mb": (64.0, 0.0, "L1 byte budget in MiB (0 = L1 off)"),
    "l1_ttl_s": (3600.0, 0.0, "L1 entry lifetime in seconds (0 = until evicted)"),
    "l2_ttl_s": (86400.0, 1.0, "L2 (Redis) entry lifetime in seconds"),
    "l2_timeout_ms": (50.0, 1.0, "Redis connect and reply timeout per call"),
    "l2_retry_interval_s": (2.0, 0.0, "after a Redis failure, skip L2 this long before trying again"),
    "warn_interval_s": (30.0, 0.0, "at most one L2 warning per this many seconds"),
}


@dataclass(frozen=True)
class CacheSettings:
    l1_max_bytes: int
    l1_ttl_s: float
    l2_redis_url: str  # "" = L2 off
    l2_ttl_s: int
    l2_timeout_s: float
    l2_retry_interval_s: float
    warn_interval_s: float

    @classmethod
    def from_config(cls, config: ModelConfig, environ: Mapping[str, str] = os.environ) -> CacheSettings:
        values: dict[str, float] = {}
        for key, (default, minimum, _) in NUMERIC.items():
            env = environ.get(ENV_PREFIX + key.upper())
            raw, where = (
                (env, f"environment variable {ENV_PREFIX + key.upper()}")
                if env not in (None, "")
                else (config.param(key), f"parameter {key!r}")
            )
            if raw is None:
                values[key] = default
                continue
            try:
                value = float(raw)
            except ValueError:
                raise ConfigError(f"model {config.name!r}: {where} must be a number, got {raw!r}") from None
            if not value >= minimum:
                raise ConfigError(f"model {config.name!r}: {where} must be >= {minimum:g}, got {raw!r}")
            values[key] = value
        url = environ.get(ENV_PREFIX + "L2_REDIS_URL") or config.param("l2_redis_url") or ""
        if url and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"model {config.name!r}: l2_redis_url must start with redis://, rediss:// or unix://, got {url!r}")
        return cls(
            l1_max_bytes=int(values["l1_max_mb"] * 1024 * 1024),
            l1_ttl_s=values["l1_ttl_s"],
            l2_redis_url=url,
            l2_ttl_s=int(values["l2_ttl_s"]),
            l2_timeout_s=values["l2_timeout_ms"] / 1000.0,
            l2_retry_interval_s=values["l2_retry_interval_s"],
            warn_interval_s=values["warn_interval_s"],
        )
