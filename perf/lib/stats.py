"""Percentiles and medians as the tools report them: the one percentile definition of the
repository (nearest rank), which every benchmark and drill reports its P50/P99 with."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import overload


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list."""
    if not sorted_values:
        raise ValueError("no values")
    rank = max(1, min(len(sorted_values), int(-(-q * len(sorted_values) // 100))))
    return sorted_values[rank - 1]


@overload
def percentile_of(values: Sequence[float], q: float, empty: float = ...) -> float: ...
@overload
def percentile_of(values: Sequence[float], q: float, empty: None) -> float | None: ...
def percentile_of(values: Sequence[float], q: float, empty: float | None = float("nan")) -> float | None:
    """``percentile`` of values in any order; ``empty`` when there are none (NaN unless given)."""
    return percentile(sorted(values), q) if len(values) else empty


def measured(figure: float | None) -> float:
    """A figure of a point that was measured: perf_analyzer gives throughput, p50 and p99 together,
    so a row or point that is ``ok`` (or has a throughput) has all three."""
    assert figure is not None, "a figure of a point that was not measured"
    return figure


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
