"""Percentiles and medians as the tools report them: the one percentile definition of the
repository (nearest rank), which every benchmark and drill reports its P50/P99 with; and the one
record of a streamed request (``Stream``: TTFT, ITL, E2E, status)."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
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


@dataclass
class Stream:
    """One streamed request as its client saw it (perf_counter seconds): when it was sent, each
    response's arrival with the tokens it carried, and how it ended."""

    system: str
    concurrency: int
    prompt_index: int
    sent: float
    events: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in that response)
    finished: bool = False
    cancelled: bool = False
    error: str = ""

    def add(self, tokens: int, at: float | None = None) -> None:
        self.events.append((time.perf_counter() if at is None else at, tokens))

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.events)

    @property
    def first(self) -> float | None:
        """When the first token arrived."""
        return next((t for t, n in self.events if n > 0), None)

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def e2e(self) -> float | None:
        """From send to the last response, for a stream that finished."""
        return self.events[-1][0] - self.sent if self.finished and self.events else None

    @property
    def status(self) -> str:
        return "error" if self.error else "cancelled" if self.cancelled else "finished" if self.finished else "open"

    def row(self) -> dict[str, object]:
        """The record as a CSV row, times in ms."""
        ms = {k: None if v is None else round(1000 * v, 1) for k, v in (("ttft_ms", self.ttft), ("e2e_ms", self.e2e))}
        return {
            "system": self.system,
            "concurrency": self.concurrency,
            "prompt": self.prompt_index,
            **ms,
            "tokens": self.tokens,
            "status": self.status,
            "finished": self.finished,
            "error": self.error,
        }


def inter_token(events: Sequence[tuple[float, int]]) -> list[float]:
    """Inter-token latencies of a stream's (arrival, tokens) responses: each gap shared by the tokens it brought."""
    out: list[float] = []
    for (t0, _), (t1, n) in itertools.pairwise(events):
        out += [(t1 - t0) / n] * n
    return out
