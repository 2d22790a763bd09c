"""The drills' record of a request (``Result``, written by ``timed``) and their report writer: the
per-second table and timeline plot of chaos and its failover scenario, the soak's interval latencies, checks
(the RSS slope per process, the P99 trend per workload), plot and tables (perf.lib.report's markdown)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from perf.lib import load
from perf.lib.report import fmt, table

MIN_ANSWERS = 5  # an interval's P99 enters the soak's trend only over at least this many answers
MIN_P99_RISE_MS = 50.0


@dataclass
class Result:
    """One request: its workload, when its answer came (seconds since the load started), its latency
    and, when it failed, the error; a stream's time to first token, and whether the client cancelled it."""

    workload: str
    end_s: float
    latency_s: float
    error: str = ""
    ttft_s: float | None = None
    cancelled: bool = False


async def timed(
    send: Callable[[str], Awaitable[tuple[float | None, bool] | None]],
    name: str,
    results: list[Result],
    start: float,
    timeout: float,
) -> None:
    """``send(name)`` (which may return a stream's TTFT and whether it was cancelled) within ``timeout``
    seconds, appended to ``results`` (times from ``start``, time.monotonic()); a failure is its error."""
    t0, error, stream = time.monotonic(), "", None
    try:
        stream = await asyncio.wait_for(send(name), timeout)
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, the run goes on
        error = f"{type(exc).__name__}: {exc}"[:400]
    now = time.monotonic()
    results.append(Result(name, now - start, now - t0, error, *(stream or ())))


def latency_ms(results: Sequence[Result]) -> dict[str, float | None]:
    """P50, P99 and max ms of the answered requests (perf.lib.load's), to 0.1 ms; None without any."""
    figures = load.latency_ms([r.latency_s for r in results if not r.error])
    return {key: None if value is None else round(value, 1) for key, value in figures.items()}


def per_second(results: Sequence[Result], duration_s: float, window_s: int = 1, skip: tuple[str, ...] = ()) -> list[dict]:
    """Requests answered and failed in each whole second (a last partial one would show a false drop),
    and P50/P99/max over the ``window_s`` seconds ending with it (``skip``: workloads left out)."""
    rows = []
    for second in range(int(duration_s)):
        inside = [r for r in results if second <= r.end_s < second + 1]
        window = [r for r in results if second + 1 - window_s <= r.end_s < second + 1 and r.workload not in skip]
        figures = {key: float("nan") if value is None else value for key, value in latency_ms(window).items()}
        answered = sum(not r.error for r in inside)
        rows.append({"second": second, "requests": len(inside), "ok": answered, "failed": len(inside) - answered, **figures})
    return rows


def timeline(path: Path, rows: Sequence[dict], events: Mapping[str, tuple[float | None, float | None]], title: str) -> None:
    """Answered and failed requests per second above, P50/P99/max below; each event (at, recovered at)
    a dashed line named in the legend, shaded until it recovered."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["second"] + 0.5 for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    a.plot(xs, [r["ok"] for r in rows], marker=".", ms=3, lw=1, label="answered requests/s")
    a.bar(xs, [r["failed"] for r in rows], color="red", label="failed requests/s")
    a.set_ylabel("requests/s")
    a.set_ylim(bottom=0)
    for key, colour in (("p50_ms", "tab:green"), ("p99_ms", "tab:orange"), ("max_ms", "tab:red")):
        b.plot(xs, [r[key] for r in rows], lw=1, color=colour, label=key[:-3].upper())
    b.set_ylabel("latency (ms)")
    b.set_xlabel("seconds since the load started")
    b.set_yscale("log")
    colours = plt.get_cmap("tab10")
    for k, (name, (at, until)) in enumerate(events.items()):
        for ax in (a, b) if at is not None else ():
            ax.axvline(at, color=colours(k), ls="--", lw=1, label=name if ax is a else None)
            if until is not None:
                ax.axvspan(at, until, color=colours(k), alpha=0.08)
    a.legend(loc="lower left", fontsize=7, ncol=3)
    b.legend(loc="upper left", fontsize=7)
    a.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------- the soak's checks


def interval_latency(t: float, results: Sequence[Result]) -> list[dict]:
    """A soak interval's row per workload (answers, errors, cancelled streams, latency P50/P99/max ms)
    and per streaming workload's time to first token (``<name>_ttft``), ending at ``t`` seconds."""
    rows = []
    for name in sorted({r.workload for r in results}):
        mine = [r for r in results if r.workload == name]
        answered = [r.latency_s for r in mine if not r.error and not r.cancelled]
        ttft = [r.ttft_s for r in mine if r.ttft_s is not None]
        errors, cancelled = sum(bool(r.error) for r in mine), sum(r.cancelled for r in mine)
        for workload, values, counts in ((name, answered, (errors, cancelled)), (f"{name}_ttft", ttft, (0, 0))):
            if values or workload == name:
                figures = {k: None if v is None else round(v, 2) for k, v in load.latency_ms(values).items()}
                row = {"time_s": round(t, 1), "workload": workload, "count": len(values), "errors": counts[0]}
                rows.append(row | {"cancelled": counts[1]} | figures)
    return rows


def fit_slope(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over ts."""
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den if den else 0.0


def robust_slope(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Theil-Sen: the median of the pairwise slopes, which one noisy interval cannot swing."""
    pairs = [(ys[j] - ys[i]) / (ts[j] - ts[i]) for i in range(len(ts)) for j in range(i + 1, len(ts)) if ts[j] != ts[i]]
    return statistics.median(pairs) if pairs else 0.0


def rss_checks(samples: Sequence[dict], warmup: float, pct: float, floor_mib: float) -> list[dict]:
    """Per process: the fitted RSS growth after the warm-up against max(``pct`` % of its RSS then, ``floor_mib``)."""
    out = []
    for name in dict.fromkeys(s["process"] for s in samples):
        rows = [s for s in samples if s["process"] == name and s["time_s"] >= warmup - 1e-6]
        if len(rows) < 3:
            out.append({"process": name, "ok": False, "note": f"{len(rows)} samples after the warm-up (3 needed)"})
            continue
        ts, ys = [r["time_s"] for r in rows], [r["rss_mib"] for r in rows]
        slope = fit_slope(ts, ys)  # MiB per second
        growth, limit = slope * (ts[-1] - ts[0]), max(pct / 100 * ys[0], floor_mib)
        out.append(
            {
                "process": name,
                "group": rows[0]["group"],
                "rss_start_mib": ys[0],
                "rss_end_mib": ys[-1],
                "rss_max_mib": max(ys),
                "slope_mib_per_min": round(60 * slope, 3),
                "fitted_growth_mib": round(growth, 2),
                "limit_mib": round(limit, 2),
                "ok": growth <= limit,
            }
        )
    return out


def p99_checks(latency: Sequence[dict], warmup: float, factor: float) -> list[dict]:
    """Per workload: the Theil-Sen rise of the interval P99s after the warm-up against
    max(``factor`` x their median, MIN_P99_RISE_MS)."""
    out = []
    for name in dict.fromkeys(r["workload"] for r in latency):
        rows = [
            r
            for r in latency
            if r["workload"] == name and r["time_s"] > warmup + 1e-6 and r["p99_ms"] is not None and r["count"] >= MIN_ANSWERS
        ]
        if len(rows) < 3:
            note = f"{len(rows)} intervals with {MIN_ANSWERS}+ answers: no trend fitted"
            out.append({"workload": name, "ok": True, "note": note})
            continue
        ts, ys = [r["time_s"] for r in rows], [r["p99_ms"] for r in rows]
        rise, median = robust_slope(ts, ys) * (ts[-1] - ts[0]), statistics.median(ys)
        limit = max(factor * median, MIN_P99_RISE_MS)
        out.append(
            {
                "workload": name,
                "p99_first_ms": ys[0],
                "p99_last_ms": ys[-1],
                "p99_median_ms": median,
                "p99_max_ms": max(ys),
                "fitted_rise_ms": round(rise, 1),
                "limit_ms": round(limit, 1),
                "ok": rise <= limit,
            }
        )
    return out


# --------------------------------------------------------------------------- the soak's report


def soak_plot(path: Path, samples: Sequence[dict], latency: Sequence[dict], warmup: float) -> None:
    """RSS per process, its change since the warm-up and the P99 per workload, over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_delta, ax_p99) = plt.subplots(3, 1, figsize=(14, 13), sharex=True)
    cmap = plt.get_cmap("tab20")
    for k, name in enumerate(dict.fromkeys(s["process"] for s in samples)):
        rows = [s for s in samples if s["process"] == name]
        ts, ys = [r["time_s"] / 60 for r in rows], [r["rss_mib"] for r in rows]
        base = next((r["rss_mib"] for r in rows if r["time_s"] >= warmup - 1e-6), ys[0])
        ax_rss.plot(ts, ys, marker=".", label=name, color=cmap(k % 20))
        ax_delta.plot(ts, [y - base for y in ys], marker=".", label=name, color=cmap(k % 20))
    for name in dict.fromkeys(r["workload"] for r in latency):
        rows = [r for r in latency if r["workload"] == name and r["p99_ms"] is not None]
        ax_p99.plot([r["time_s"] / 60 for r in rows], [r["p99_ms"] for r in rows], marker=".", label=name)
    ax_rss.set_title("RSS per process")
    ax_delta.axhline(0, color="grey", lw=0.5)
    labels = ("RSS (MiB, log)", "RSS change since the warm-up (MiB)", "P99 per interval (ms, log)")
    for ax, label in zip((ax_rss, ax_delta, ax_p99), labels):
        ax.set_ylabel(label)
        ax.set_yscale("log" if "log" in label else "linear")
        ax.axvline(warmup / 60, color="grey", ls="--", lw=0.8)
    for ax in (ax_rss, ax_p99):
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax_p99.set_xlabel("minutes (dashed: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def soak_tables(
    results: Sequence[Result], samples: Sequence[dict], latency: Sequence[dict], rss: Sequence[dict], p99: Sequence[dict]
) -> list[str]:
    """The soak's summary tables: answers per workload, RSS and CPU per process, P99 trend per workload,
    P99 per interval."""
    counts: dict[str, Counter] = {}
    for r in results:
        kind = "failed" if r.error else "cancelled" if r.cancelled else "ok"
        counts.setdefault(r.workload, Counter()).update({kind: 1, "refused": "HTTP 503" in r.error})
    rows = [[n, c["ok"], c["cancelled"], c["failed"], c["refused"]] for n, c in counts.items()]
    lines = [table(["workload", "answered", "cancelled", "errors", "of which refused (503)"], rows)]
    if errors := [f"{r.workload}: {r.error}" for r in results if r.error]:
        lines += ["", "First errors:", "", *[f"- `{e}`" for e in errors[:10]]]
    cores: dict[str, list[float]] = {}
    for s in samples:
        if s["cpu_cores"] is not None:
            cores.setdefault(s["process"], []).append(s["cpu_cores"])
    header = ["process", "RSS after warm-up MiB", "RSS at end MiB", "max MiB", "slope MiB/min", "fitted growth MiB"]
    rows = [
        [r["process"], fmt(r.get("rss_start_mib")), fmt(r.get("rss_end_mib")), fmt(r.get("rss_max_mib"))]
        + [fmt(r.get("slope_mib_per_min"), 3), fmt(r.get("fitted_growth_mib"), 2), fmt(r.get("limit_mib"))]
        + [fmt(statistics.fmean(cores[r["process"]]) if cores.get(r["process"]) else None, 3)]
        + ["yes" if r["ok"] else "NO " + r.get("note", "")]
        for r in rss
    ]
    lines += ["", table([*header, "limit MiB", "mean CPU cores", "ok"], rows)]
    rows = [
        [r["workload"], *(fmt(r.get(k)) for k in ("p99_first_ms", "p99_last_ms", "p99_median_ms", "p99_max_ms"))]
        + [fmt(r.get("fitted_rise_ms")), fmt(r.get("limit_ms"))]
        + [("yes" if r["ok"] else "NO") + (f" ({r['note']})" if r.get("note") else "")]
        for r in p99
    ]
    header = ["workload", "P99 first ms", "P99 last ms", "median ms", "max interval P99 ms", "fitted rise ms", "limit ms"]
    lines += ["", table([*header, "ok"], rows)]
    workloads = list(dict.fromkeys(r["workload"] for r in latency))
    by = {(r["time_s"], r["workload"]): r for r in latency}
    rows = [
        [f"{t:.0f}", *(fmt(by.get((t, w), {}).get("p99_ms")) for w in workloads)] for t in sorted({r["time_s"] for r in latency})
    ]
    lines += ["", "P99 per interval (ms; P50 / P99 / max in latency.csv):", "", table(["t (s)", *workloads], rows, left=0)]
    return lines
