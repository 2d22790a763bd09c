"""perf.bench.tail's summary: the points (medians over rounds), the targets and the tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from perf.bench.tail_measure import Window
from perf.bench.tail_workloads import HIT_WORKLOADS, STATS_MODELS, STREAM_WORKLOADS, WORKLOADS
from perf.lib import load
from perf.lib.stats import median

TARGET_MAX_OVER_P50 = 5.0
TARGET_HITS_P99_MS = 50.0
TARGET_P99_OVER_P50 = 3.0


# --------------------------------------------------------------------------- summary


@dataclass
class Point(load.TailRatios):
    """The rounds of one phase, workload and concurrency: medians, and the largest max."""

    phase: str
    workload: str
    concurrency: int
    rounds: int
    requests: int
    errors: int
    rps: float | None
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    p99_range: tuple[float, float] | None
    client_cores: float | None
    server_cores: float | None
    server_wait_cores: float | None
    machine_cores: float | None
    stats: dict
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttft_max_ms: float | None = None
    gateway_cores: float | None = None


def points(windows: Sequence[Window]) -> list[Point]:
    groups: dict[tuple[str, str, int], list[Window]] = {}
    for w in windows:
        groups.setdefault((w.phase, w.workload, w.concurrency), []).append(w)
    out = []
    for (phase, workload, conc), ws in groups.items():
        p99s = [w.p99_ms for w in ws if w.p99_ms is not None]
        stats: dict[str, dict] = {}
        for model in {m for w in ws for m in w.stats}:
            per = [w.stats[model] for w in ws if model in w.stats]
            stats[model] = {k: median([s[k] for s in per]) for k in ("batch", "queue_ms", "compute_ms")}
        out.append(
            Point(
                phase,
                workload,
                conc,
                len(ws),
                sum(w.requests for w in ws),
                sum(w.errors for w in ws),
                median([w.rps for w in ws]),
                median([w.p50_ms for w in ws]),
                median(p99s),
                max((w.max_ms for w in ws if w.max_ms is not None), default=None),
                (min(p99s), max(p99s)) if p99s else None,
                median([w.client_cores for w in ws]),
                median([w.server_cores for w in ws]),
                median([w.server_wait_cores for w in ws]),
                median([w.machine_cores for w in ws]),
                stats,
                median([w.ttft_p50_ms for w in ws]),
                median([w.ttft_p99_ms for w in ws]),
                max((w.ttft_max_ms for w in ws if w.ttft_max_ms is not None), default=None),
                median([w.gateway_cores for w in ws]),
            )
        )
    return out


def targets(results: Sequence[Point], concurrency: int, phase: str = "after", long: bool = False) -> list[dict]:
    """The issue's targets, checked on ``phase`` at ``concurrency``: all-hit P99 <= 50 ms, every other
    workload P99 <= 3 x P50 (streams: the whole answer and TTFT), and with ``long`` (one long window
    per workload) max <= 5 x P50. Each row: target, value, met, and the figures it comes from."""
    rows = []
    by = {(r.phase, r.workload, r.concurrency): r for r in results}

    def row(target: str, value: float | None, limit: float, r: Point, detail: str) -> None:
        rows.append(
            {
                "target": target,
                "value": value,
                "limit": limit,
                "detail": detail,
                "met": value is not None and value <= limit and not r.errors,
                "cores": f"client {_f(r.client_cores, 2)}, server {_f(r.server_cores, 2)} "
                f"(waiting {_f(r.server_wait_cores, 2)}), machine {_f(r.machine_cores, 2)}",
            }
        )

    for name in WORKLOADS:
        r = by.get((phase, name, concurrency))
        if r is None:
            continue
        c = f"c{concurrency}"
        if name in HIT_WORKLOADS:
            row(f"{name}, {c}: P99 <= {TARGET_HITS_P99_MS:g} ms", r.p99_ms, TARGET_HITS_P99_MS, r, f"P99 {_f(r.p99_ms)} ms")
        else:
            what = "answer " if name in STREAM_WORKLOADS else ""
            row(
                f"{name}, {c}: {what}P99 <= {TARGET_P99_OVER_P50:g} x P50",
                r.p99_over_p50,
                TARGET_P99_OVER_P50,
                r,
                f"P50 {_f(r.p50_ms)}, P99 {_f(r.p99_ms)} ms",
            )
        if name in STREAM_WORKLOADS and r.ttft_p50_ms:
            row(
                f"{name}, {c}: TTFT P99 <= {TARGET_P99_OVER_P50:g} x P50",
                (r.ttft_p99_ms or 0) / r.ttft_p50_ms,
                TARGET_P99_OVER_P50,
                r,
                f"TTFT P50 {_f(r.ttft_p50_ms)}, P99 {_f(r.ttft_p99_ms)} ms",
            )
        if long:
            row(
                f"{name}, {c}: max <= {TARGET_MAX_OVER_P50:g} x P50 (long window)",
                r.max_over_p50,
                TARGET_MAX_OVER_P50,
                r,
                f"P50 {_f(r.p50_ms)}, max {_f(r.max_ms)} ms",
            )
            if name in STREAM_WORKLOADS and r.ttft_p50_ms:
                row(
                    f"{name}, {c}: TTFT max <= {TARGET_MAX_OVER_P50:g} x P50 (long window)",
                    (r.ttft_max_ms or 0) / r.ttft_p50_ms,
                    TARGET_MAX_OVER_P50,
                    r,
                    f"TTFT P50 {_f(r.ttft_p50_ms)}, max {_f(r.ttft_max_ms)} ms",
                )
    return rows


def targets_table(rows: Sequence[dict]) -> str:
    """The targets as a markdown table: each target, the figure, PASS / FAIL, and the CPU beside it."""
    lines = ["| target | value | result | from | CPU cores (client, server, machine) |", "| --- | ---: | --- | --- | --- |"]
    for t in rows:
        lines.append(f"| {t['target']} | {_f(t['value'], 2)} | {'PASS' if t['met'] else 'FAIL'} | {t['detail']} | {t['cores']} |")
    return "\n".join(lines) + "\n"


def _f(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(header: Sequence[str], results: Sequence[Point], target_rows: Sequence[dict]) -> str:
    lines = list(header) + [
        "",
        "| workload | conc. | phase | requests/s | P50 ms | P99 ms (rounds) | max ms | P99/P50 | errors | "
        "client cores | server cores | server waiting | machine cores |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ordered = sorted(results, key=lambda r: (WORKLOADS.index(r.workload), r.concurrency, r.phase != "before", r.phase))
    for r in ordered:
        spread = f" ({_f(r.p99_range[0])}-{_f(r.p99_range[1])})" if r.p99_range and r.rounds > 1 else ""
        lines.append(
            f"| {r.workload} | {r.concurrency} | {r.phase} | {_f(r.rps, 0 if r.rps and r.rps > 100 else 1)} | "
            f"{_f(r.p50_ms)} | {_f(r.p99_ms)}{spread} | {_f(r.max_ms)} | {_f(r.p99_over_p50, 2)} | {r.errors} | "
            f"{_f(r.client_cores, 2)} | {_f(r.server_cores, 2)} | {_f(r.server_wait_cores, 2)} | "
            f"{_f(r.machine_cores, 2)} |"
        )
    streams = [r for r in ordered if r.workload in STREAM_WORKLOADS]
    if streams:
        lines += [
            "",
            "Streams (P50/P99/max above are of the whole answer): time to the first text piece.",
            "",
            ("| workload | conc. | phase | answers/s | TTFT P50 ms | TTFT P99 ms | TTFT max ms | TTFT P99/P50 | gateway cores |"),
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in streams:
            ratio = r.ttft_p99_ms / r.ttft_p50_ms if r.ttft_p99_ms and r.ttft_p50_ms else None
            lines.append(
                f"| {r.workload} | {r.concurrency} | {r.phase} | {_f(r.rps, 1)} | {_f(r.ttft_p50_ms)} | "
                f"{_f(r.ttft_p99_ms)} | {_f(r.ttft_max_ms)} | {_f(ratio, 2)} | {_f(r.gateway_cores, 2)} |"
            )
    if target_rows:
        lines += ["", "Targets:", "", targets_table(target_rows).rstrip("\n")]
    lines += [
        "",
        "Where the time goes (/v2/models/stats, medians over rounds): mean batch, queue ms and "
        "compute ms per request of each model the workload reached.",
        "",
        "| workload | conc. | phase | model | batch | queue ms | compute ms |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for r in ordered:
        for model in (m for m in STATS_MODELS if m in r.stats):
            s = r.stats[model]
            lines.append(
                f"| {r.workload} | {r.concurrency} | {r.phase} | {model} | {_f(s['batch'], 2)} | "
                f"{_f(s['queue_ms'], 2)} | {_f(s['compute_ms'], 2)} |"
            )
    return "\n".join(lines) + "\n"
