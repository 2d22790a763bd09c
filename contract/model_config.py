"""Typed access to a parsed Triton model configuration (the JSON form of config.pbtxt).

Triton hands every Python model its configuration as JSON in ``args["model_config"]``.
The shims read dtypes, shapes and ``parameters { }`` through this module instead of
repeating them in code, so config.pbtxt stays the one source of truth.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from contract.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as declared in config.pbtxt (dims exclude the batch axis)."""

    name: str
    data_type: str
    dims: tuple[int, ...]


class ModelConfig:
    """A parsed model configuration with helpers for the fields the backends use."""

    def __init__(self, config: Mapping[str, Any] | str):
        self.raw: dict[str, Any] = json.loads(config) if isinstance(config, str) else dict(config)
        self.name: str = self.raw.get("name", "<unnamed>")
        self.max_batch_size: int = int(self.raw.get("max_batch_size", 0))
        self.inputs = [self._spec(t) for t in self.raw.get("input", [])]
        self.outputs = [self._spec(t) for t in self.raw.get("output", [])]

    @staticmethod
    def _spec(t: Mapping[str, Any]) -> TensorSpec:
        return TensorSpec(t["name"], t["data_type"], tuple(int(d) for d in t.get("dims", [])))

    def input(self, name: str) -> TensorSpec:
        return self._find(self.inputs, name, "input")

    def output(self, name: str) -> TensorSpec:
        return self._find(self.outputs, name, "output")

    def _find(self, specs: Sequence[TensorSpec], name: str, kind: str) -> TensorSpec:
        for spec in specs:
            if spec.name == name:
                return spec
        declared = ", ".join(s.name for s in specs) or "none"
        raise ConfigError(f"model {self.name!r}: config declares no {kind} named {name!r} (declared: {declared})")

    def require(self, kind: str, name: str, data_type: str, dims: tuple[int, ...] | None = None) -> TensorSpec:
        """Check at load time that the config declares a tensor as the code expects."""
        spec = self.input(name) if kind == "input" else self.output(name)
        if spec.data_type != data_type:
            raise ConfigError(f"model {self.name!r}: {kind} {name!r} must be {data_type}, config says {spec.data_type}")
        if dims is not None and spec.dims != dims:
            raise ConfigError(f"model {self.name!r}: {kind} {name!r} must have dims {list(dims)}, config says {list(spec.dims)}")
        return spec

    @overload
    def param(self, key: str) -> str | None: ...

    @overload
    def param(self, key: str, default: str) -> str: ...

    @overload
    def param(self, key: str, default: str | None) -> str | None: ...

    # parameters { key: "..." value: { string_value: "..." } }
    def param(self, key: str, default: str | None = None) -> str | None:
        entry = self.raw.get("parameters", {}).get(key)
        if entry is None:
            return default
        value = entry.get("string_value", "") if isinstance(entry, Mapping) else str(entry)
        return value if value != "" else default

    def instance_count(self) -> int:
        """Instances of this model on this server: the sum of its instance groups' counts
        (Triton's JSON config says "count" for each group)."""
        groups = self.raw.get("instance_group") or [{}]
        return sum(max(1, int(g.get("count", 1) or 1)) for g in groups)

    def param_int(self, key: str, default: int, minimum: int | None = None) -> int:
        raw = self.param(key)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"model {self.name!r}: parameter {key!r} must be an integer, got {raw!r}") from None
        if minimum is not None and value < minimum:
            raise ConfigError(f"model {self.name!r}: parameter {key!r} must be >= {minimum}, got {value}")
        return value

    def param_bool(self, key: str, default: bool) -> bool:
        raw = self.param(key)
        if raw is None:
            return default
        lowered = raw.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ConfigError(f"model {self.name!r}: parameter {key!r} must be a boolean (1/0/true/false), got {raw!r}")

    def param_int_list(self, key: str, default: Sequence[int]) -> list[int]:
        raw = self.param(key)
        if raw is None:
            return list(default)
        try:
            return [int(v) for v in raw.replace(" ", "").split(",") if v]
        except ValueError:
            raise ConfigError(f"model {self.name!r}: parameter {key!r} must be comma-separated integers, got {raw!r}") from None

    def params_with_prefix(self, prefix: str) -> dict[str, str]:
        out = {}
        for key in self.raw.get("parameters", {}):
            if key.startswith(prefix):
                value = self.param(key)
                if value is not None:
                    out[key] = value
        return out

    def execution_accelerators(self, which: str) -> list[dict[str, Any]]:
        """``which`` is "gpu" or "cpu"; returns [{"name": ..., "parameters": {...}}]."""
        accel = self.raw.get("optimization", {}).get("execution_accelerators", {})
        return [
            {"name": a.get("name", ""), "parameters": dict(a.get("parameters", {}))}
            for a in accel.get(f"{which}_execution_accelerator", [])
        ]

    def graph_optimization_level(self) -> int | None:
        level = self.raw.get("optimization", {}).get("graph", {}).get("level")
        return None if level is None else int(level)


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The padded length of a batch whose longest row has ``length`` tokens: the smallest of a
    model's sequence buckets (its config's ``sequence_buckets``, sorted ascending) >= length; the
    largest if none is."""
    i = bisect.bisect_left(buckets, length)
    return buckets[min(i, len(buckets) - 1)]
