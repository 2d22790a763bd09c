"""perf.bench.tail's summary: the targets and the tables of its points (perf.lib.load.points: medians over rounds)."""

from __future__ import annotations

from collections.abc import Sequence

from perf.bench.tail_measure import Window
from perf.bench.tail_workloads import HIT_WORKLOADS, STATS_MODELS, STREAM_WORKLOADS, WORKLOADS
from perf.lib.report import fmt as _f
from perf.lib.report import table

TARGET_MAX_OVER_P50 = 5.0
TARGET_HITS_P99_MS = 50.0
TARGET_P99_OVER_P50 = 3.0


def targets(results: Sequence[Window], concurrency: int, phase: str = "after", long: bool = False) -> list[dict]:
    """The issue's targets, checked on ``phase`` at ``concurrency``: all-hit P99 <= 50 ms, every other
    workload P99 <= 3 x P50 (streams: the whole answer and TTFT), and with ``long`` (one long window
    per workload) max <= 5 x P50. Each row: target, value, met, and the figures it comes from."""
    rows = []
    by = {(r.phase, r.workload, r.concurrency): r for r in results}
    ratio, most = f"{TARGET_P99_OVER_P50:g} x P50", f"{TARGET_MAX_OVER_P50:g} x P50 (long window)"
    for name in WORKLOADS:
        if (r := by.get((phase, name, concurrency))) is None:
            continue
        if name in HIT_WORKLOADS:
            checks = [(f"P99 <= {TARGET_HITS_P99_MS:g} ms", r.p99_ms, TARGET_HITS_P99_MS, f"P99 {_f(r.p99_ms)} ms")]
        else:
            what = "answer " if name in STREAM_WORKLOADS else ""
            checks = [
                (f"{what}P99 <= {ratio}", r.p99_over_p50, TARGET_P99_OVER_P50, f"P50 {_f(r.p50_ms)}, P99 {_f(r.p99_ms)} ms")
            ]
        ttft = r.ttft_p50_ms if name in STREAM_WORKLOADS else None
        if ttft:
            detail = f"TTFT P50 {_f(ttft)}, P99 {_f(r.ttft_p99_ms)} ms"
            checks.append((f"TTFT P99 <= {ratio}", (r.ttft_p99_ms or 0) / ttft, TARGET_P99_OVER_P50, detail))
        if long:
            checks.append((f"max <= {most}", r.max_over_p50, TARGET_MAX_OVER_P50, f"P50 {_f(r.p50_ms)}, max {_f(r.max_ms)} ms"))
        if long and ttft:
            detail = f"TTFT P50 {_f(ttft)}, max {_f(r.ttft_max_ms)} ms"
            checks.append((f"TTFT max <= {most}", (r.ttft_max_ms or 0) / ttft, TARGET_MAX_OVER_P50, detail))
        cores = f"client {_f(r.client_cores, 2)}, server {_f(r.server_cores, 2)} (waiting {_f(r.server_wait_cores, 2)})"
        cores += f", machine {_f(r.machine_cores, 2)}"
        for what, value, limit, detail in checks:
            met = value is not None and value <= limit and not r.errors
            row = {"target": f"{name}, c{concurrency}: {what}", "value": value, "limit": limit, "detail": detail}
            rows.append(row | {"met": met, "cores": cores})
    return rows


def targets_table(rows: Sequence[dict]) -> str:
    """The targets as a markdown table: each target, the figure, PASS / FAIL, and the CPU beside it."""
    header = ["target", "value", "result", "from", "CPU cores (client, server, machine)"]
    body = [(t["target"], _f(t["value"], 2), "PASS" if t["met"] else "FAIL", t["detail"], t["cores"]) for t in rows]
    return table(header, body) + "\n"


def markdown(header: Sequence[str], results: Sequence[Window], target_rows: Sequence[dict]) -> str:
    ordered = sorted(results, key=lambda r: (WORKLOADS.index(r.workload), r.concurrency, r.phase != "before", r.phase))
    rows: list[tuple] = []
    for r in ordered:
        spread = f" ({_f(r.p99_range[0])}-{_f(r.p99_range[1])})" if r.p99_range and r.round > 1 else ""
        rps = _f(r.rps, 0 if r.rps and r.rps > 100 else 1)
        rows.append(
            (r.workload, r.phase, r.concurrency, rps, _f(r.p50_ms), _f(r.p99_ms) + spread, _f(r.max_ms), _f(r.p99_over_p50, 2))
            + (r.errors, _f(r.client_cores, 2), _f(r.server_cores, 2), _f(r.server_wait_cores, 2), _f(r.machine_cores, 2))
        )
    columns = ["workload", "phase", "conc.", "requests/s", "P50 ms", "P99 ms (rounds)", "max ms", "P99/P50", "errors"]
    lines = [*header, "", table(columns + ["client cores", "server cores", "server waiting", "machine cores"], rows, left=2)]
    streams = [r for r in ordered if r.workload in STREAM_WORKLOADS]
    if streams:
        columns = ["workload", "phase", "conc.", "answers/s", "TTFT P50 ms", "TTFT P99 ms", "TTFT max ms", "TTFT P99/P50"]
        rows = [
            (r.workload, r.phase, r.concurrency, _f(r.rps, 1), _f(r.ttft_p50_ms), _f(r.ttft_p99_ms), _f(r.ttft_max_ms))
            + (_f(r.ttft_p99_ms / r.ttft_p50_ms if r.ttft_p99_ms and r.ttft_p50_ms else None, 2), _f(r.gateway_cores, 2))
            for r in streams
        ]
        lines += ["", "Streams (P50/P99/max above are of the whole answer): time to the first text piece.", ""]
        lines.append(table(columns + ["gateway cores"], rows, left=2))
    if target_rows:
        lines += ["", "Targets:", "", targets_table(target_rows).rstrip("\n")]
    rows = [
        (r.workload, r.phase, model, r.concurrency, _f(s["batch"], 2), _f(s["queue_ms"], 2), _f(s["compute_ms"], 2))
        for r in ordered
        for model, s in ((m, r.stats[m]) for m in STATS_MODELS if m in r.stats)
    ]
    lines += [
        "",
        "Where the time goes (/v2/models/stats, medians over rounds): mean batch, queue ms and "
        "compute ms per request of each model the workload reached.",
        "",
        table(["workload", "phase", "model", "conc.", "batch", "queue ms", "compute ms"], rows, left=3),
    ]
    return "\n".join(lines) + "\n"
