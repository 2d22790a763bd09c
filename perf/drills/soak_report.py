"""perf.drills.soak's checks (the RSS slope per process, the P99 trend per workload) and its report
(soak.png, summary.md)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from perf.drills.soak import Recorder, Soak

MIN_ANSWERS = 5  # an interval's P99 enters the trend only over at least this many answers
MIN_P99_RISE_MS = 50.0


# --------------------------------------------------------------------------- checks


def fit_slope(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over ts."""
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den if den else 0.0


def rss_checks(samples: Sequence[dict], warmup: float, pct: float, floor_mib: float) -> list[dict]:
    out = []
    for name in dict.fromkeys(s["process"] for s in samples):
        rows = [s for s in samples if s["process"] == name and s["time_s"] >= warmup - 1e-6]
        if len(rows) < 3:
            out.append({"process": name, "ok": False, "note": f"{len(rows)} samples after the warm-up (3 needed)"})
            continue
        ts = [r["time_s"] for r in rows]
        ys = [r["rss_mib"] for r in rows]
        slope = fit_slope(ts, ys)  # MiB per second
        growth = slope * (ts[-1] - ts[0])
        limit = max(pct / 100 * ys[0], floor_mib)
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


def robust_slope(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Theil-Sen: the median of the pairwise slopes, which one noisy interval cannot swing."""
    pairs = [(ys[j] - ys[i]) / (ts[j] - ts[i]) for i in range(len(ts)) for j in range(i + 1, len(ts)) if ts[j] != ts[i]]
    return statistics.median(pairs) if pairs else 0.0


def p99_checks(latency: Sequence[dict], warmup: float, factor: float) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["workload"] for r in latency):
        rows = [
            r
            for r in latency
            if r["workload"] == name and r["time_s"] > warmup + 1e-6 and r["p99_ms"] is not None and r["count"] >= MIN_ANSWERS
        ]
        if len(rows) < 3:
            out.append(
                {"workload": name, "ok": True, "note": f"{len(rows)} intervals with {MIN_ANSWERS}+ answers: no trend fitted"}
            )
            continue
        ts = [r["time_s"] for r in rows]
        ys = [r["p99_ms"] for r in rows]
        rise = robust_slope(ts, ys) * (ts[-1] - ts[0])
        median = statistics.median(ys)
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


# --------------------------------------------------------------------------- report


def plot(path: Path, soak: Soak, warmup: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_delta, ax_p99) = plt.subplots(3, 1, figsize=(14, 13), sharex=True)
    names = list(dict.fromkeys(s["process"] for s in soak.samples))
    cmap = plt.get_cmap("tab20")
    for k, name in enumerate(names):
        rows = [s for s in soak.samples if s["process"] == name]
        ts = [r["time_s"] / 60 for r in rows]
        ys = [r["rss_mib"] for r in rows]
        ax_rss.plot(ts, ys, marker=".", label=name, color=cmap(k % 20))
        base = next((r["rss_mib"] for r in rows if r["time_s"] >= warmup - 1e-6), ys[0])
        ax_delta.plot(ts, [y - base for y in ys], marker=".", label=name, color=cmap(k % 20))
    ax_rss.set_yscale("log")
    ax_rss.set_ylabel("RSS (MiB, log)")
    ax_rss.set_title("RSS per process")
    ax_rss.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax_delta.set_ylabel("RSS change since the warm-up (MiB)")
    ax_delta.axhline(0, color="grey", lw=0.5)
    for ax in (ax_rss, ax_delta, ax_p99):
        ax.axvline(warmup / 60, color="grey", ls="--", lw=0.8)
    for name in dict.fromkeys(r["workload"] for r in soak.latency):
        rows = [r for r in soak.latency if r["workload"] == name and r["p99_ms"] is not None]
        if rows:
            ax_p99.plot([r["time_s"] / 60 for r in rows], [r["p99_ms"] for r in rows], marker=".", label=name)
    ax_p99.set_yscale("log")
    ax_p99.set_ylabel("P99 per interval (ms, log)")
    ax_p99.set_xlabel("minutes (dashed: end of warm-up)")
    ax_p99.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _f(v, digits: int = 1) -> str:
    return "" if v is None else (f"{v:,.{digits}f}" if isinstance(v, float) else str(v))


def summary(
    header: Sequence[str], soak: Soak, rec: Recorder, rss: Sequence[dict], p99: Sequence[dict], failures: Sequence[str]
) -> str:
    lines = list(header) + ["", f"**Result: {'FAILED: ' + '; '.join(failures) if failures else 'passed'}**", ""]
    lines += ["| workload | answered | cancelled | errors | of which refused (503) |", "| --- | ---: | ---: | ---: | ---: |"]
    for name in dict.fromkeys([*rec.ok, *rec.cancelled, *rec.failed]):
        lines.append(
            f"| {name} | {rec.ok.get(name, 0)} | {rec.cancelled.get(name, 0)} | {rec.failed.get(name, 0)} | "
            f"{rec.refused.get(name, 0)} |"
        )
    if rec.errors:
        lines += ["", "First errors:", ""] + [f"- `{e}`" for e in rec.errors[:10]]
    if soak.lost:
        lines += ["", f"Processes that exited during the soak: {', '.join(soak.lost)}"]
    cores: dict[str, list[float]] = {}
    for s in soak.samples:
        if s["cpu_cores"] is not None:
            cores.setdefault(s["process"], []).append(s["cpu_cores"])
    lines += [
        "",
        (
            "| process | RSS after warm-up MiB | RSS at end MiB | max MiB | slope MiB/min | fitted growth MiB | "
            "limit MiB | mean CPU cores | ok |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rss:
        mean = statistics.fmean(cores[r["process"]]) if cores.get(r["process"]) else None
        lines.append(
            f"| {r['process']} | {_f(r.get('rss_start_mib'))} | {_f(r.get('rss_end_mib'))} | "
            f"{_f(r.get('rss_max_mib'))} | {_f(r.get('slope_mib_per_min'), 3)} | {_f(r.get('fitted_growth_mib'), 2)} | "
            f"{_f(r.get('limit_mib'))} | {_f(mean, 3)} | {'yes' if r['ok'] else 'NO ' + r.get('note', '')} |"
        )
    lines += [
        "",
        ("| workload | P99 first ms | P99 last ms | median ms | max interval P99 ms | fitted rise ms | limit ms | ok |"),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in p99:
        lines.append(
            f"| {r['workload']} | {_f(r.get('p99_first_ms'))} | {_f(r.get('p99_last_ms'))} | "
            f"{_f(r.get('p99_median_ms'))} | {_f(r.get('p99_max_ms'))} | {_f(r.get('fitted_rise_ms'))} | "
            f"{_f(r.get('limit_ms'))} | {'yes' if r['ok'] else 'NO'}{' (' + r['note'] + ')' if r.get('note') else ''} |"
        )
    workloads = list(dict.fromkeys(r["workload"] for r in soak.latency))
    times = sorted({r["time_s"] for r in soak.latency})
    by = {(r["time_s"], r["workload"]): r for r in soak.latency}
    lines += [
        "",
        "P99 per interval (ms; P50 / P99 / max in latency.csv):",
        "",
        "| t (s) | " + " | ".join(workloads) + " |",
        "| ---: |" + " ---: |" * len(workloads),
    ]
    for t in times:
        lines.append(f"| {t:.0f} | " + " | ".join(_f(by.get((t, w), {}).get("p99_ms")) for w in workloads) + " |")
    return "\n".join(lines) + "\n"
