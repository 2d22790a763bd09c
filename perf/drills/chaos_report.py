"""perf.drills.chaos's record of a run (every answer and fault) and its report: the per-second table,
chaos.png, the checks and summary.md."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from perf.lib.stats import percentile_of

MIX = {"embed": 25, "embed_grpc": 15, "cached": 30, "gateway": 15, "image": 10, "generation": 5}
# No failure allowed: idempotent requests through clients that retry, and generation streams (the
# gRPC door continues a stream whose replica died: server/stream_resume.py).
RETRIED = ("embed", "embed_grpc", "cached", "gateway", "generation")


@dataclass
class Result:
    workload: str
    end_s: float
    latency_s: float
    error: str = ""


@dataclass
class Fault:
    name: str
    at_s: float | None = None
    recovered_s: float | None = None  # seconds after at_s
    detail: str = ""


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    faults: dict[str, Fault] = field(default_factory=dict)
    start: float = 0.0


def clean_failure(error: str) -> bool:
    """A failure a client can act on: UNAVAILABLE, or 502/503 from the front door (retry later)."""
    return any(mark in error for mark in ("UNAVAILABLE", "HTTP 503", "HTTP 502", "unavailable"))


# --------------------------------------------------------------------------- report


WINDOW_S = 5  # the P99 and max of each second are over the 5 seconds ending with it (a second holds ~20 answers)


def per_second(run: Run, duration_s: float) -> list[dict]:
    rows = []
    for second in range(int(duration_s)):
        inside = [r for r in run.results if second <= r.end_s < second + 1]
        window = [
            r.latency_s * 1000
            for r in run.results
            if second + 1 - WINDOW_S <= r.end_s < second + 1 and not r.error and r.workload != "generation"
        ]
        rows.append(
            {
                "second": second,
                "ok": sum(not r.error for r in inside),
                "failed": sum(bool(r.error) for r in inside),
                "p99_ms_5s": round(percentile_of(window, 99), 1),
                "max_ms_5s": round(max(window), 1) if window else float("nan"),
            }
        )
    return rows


def plot(path: Path, rows: list[dict], faults: dict[str, Fault], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["second"] + 0.5 for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    a.plot(xs, [r["ok"] for r in rows], lw=0.6, color="tab:blue", alpha=0.4, label="answered requests/s")
    smooth = [
        sum(r["ok"] for r in rows[max(0, i - WINDOW_S + 1) : i + 1]) / len(rows[max(0, i - WINDOW_S + 1) : i + 1])
        for i in range(len(rows))
    ]
    a.plot(xs, smooth, lw=1.5, color="tab:blue", label=f"answered, {WINDOW_S} s mean")
    a.bar(xs, [r["failed"] for r in rows], color="red", label="failed requests/s")
    a.set_ylabel("requests/s")
    a.set_ylim(bottom=0)
    b.plot(
        xs, [r["p99_ms_5s"] for r in rows], lw=1, color="tab:orange", label=f"P99 over {WINDOW_S} s (all but generation streams)"
    )
    b.plot(xs, [r["max_ms_5s"] for r in rows], lw=0.6, color="tab:red", alpha=0.5, label=f"max over {WINDOW_S} s")
    b.set_ylabel("latency (ms)")
    b.set_xlabel("seconds since the load started")
    b.set_yscale("log")
    colours = ["tab:red", "tab:purple", "tab:blue", "tab:green", "black"]
    for colour, fault in zip(colours, faults.values()):
        if fault.at_s is None:
            continue
        for ax in (a, b):
            ax.axvline(fault.at_s, color=colour, ls="--", lw=1, label=fault.name if ax is a else None)
            if fault.recovered_s is not None:
                ax.axvspan(fault.at_s, fault.at_s + fault.recovered_s, color=colour, alpha=0.08)
    a.legend(loc="lower left", fontsize=7, ncol=3)
    b.legend(loc="upper left", fontsize=7)
    a.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summarize(run: Run) -> dict:
    out = {}
    for name in MIX:
        mine = [r for r in run.results if r.workload == name]
        failed = [r for r in mine if r.error]
        lat = [r.latency_s * 1000 for r in mine if not r.error]
        out[name] = {
            "sent": len(mine),
            "failed": len(failed),
            "unclean": sum(not clean_failure(r.error) for r in failed),
            "p50_ms": round(percentile_of(lat, 50), 1),
            "p99_ms": round(percentile_of(lat, 99), 1),
            "max_ms": round(max(lat), 1) if lat else None,
            "errors": sorted({r.error[:160] for r in failed})[:5],
        }
    return out


def checks(table: dict, faults: dict[str, Fault], burst: dict) -> list[str]:
    problems = []
    for name, row in table.items():
        if name in RETRIED and row["failed"]:
            problems.append(f"{name}: {row['failed']} failed requests through a retrying or continuing path ({row['errors']})")
        elif row["unclean"]:
            problems.append(f"{name}: {row['unclean']} failures that are not a clean UNAVAILABLE/502/503 ({row['errors']})")
    for fault in faults.values():
        if fault.recovered_s is None:
            problems.append(f"fault {fault.name}: not recovered ({fault.detail.strip()})")
    if burst.get("server errors"):
        problems.append(
            f"hostile burst: {burst['server errors']} server errors {burst['kinds']}: "
            f"{[(f['endpoint'], f['outcome'], f['detail'][:150]) for f in burst['findings'][:5]]}"
        )
    if burst.get("stubs_gone"):
        problems.append(f"hostile burst: stubs gone afterwards {burst['stubs_gone']}")
    return problems


def streams_continued(state: dict) -> int:
    """New calls the gRPC door opened to continue streams (its log, beside the front door's)."""
    log = Path(state["front_door"]["log"]).parent / "grpc-door.log"
    try:
        return log.read_text(encoding="utf-8", errors="replace").count("continued on a new call")
    except OSError:
        return 0


def write_summary(
    path: Path,
    args,
    rate: float,
    peak_rps: float,
    table: dict,
    faults: dict[str, Fault],
    rss: tuple[float, float],
    burst: dict,
    problems: list[str],
    cpu: str,
) -> str:
    lines = [
        f"# chaos soak: {args.duration:.0f} s at {args.load:.0%} of the peak ({peak_rps:.1f} answers/s -> "
        f"{rate:.1f} requests/s), {args.replicas} replicas",
        "",
        f"CPU: {cpu}. Command: `python -m perf.drills.chaos --duration {args.duration:.0f}`",
        "",
        "| workload | client | sent | failed | not clean | P50 ms | P99 ms | max ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    clients = {
        "embed": "clients.embeddings.aio HTTP (retries)",
        "embed_grpc": "clients.embeddings.aio gRPC (retries)",
        "cached": "clients.embeddings.aio HTTP (retries)",
        "gateway": "openai SDK (retries)",
        "image": "aiohttp (no retries)",
        "generation": "clients.generation gRPC stream (continued)",
    }
    for name, row in table.items():
        lines.append(
            f"| {name} | {clients[name]} | {row['sent']:,} | {row['failed']} | {row['unclean']} | "
            f"{row['p50_ms']} | {row['p99_ms']} | {row['max_ms']} |"
        )
    lines += ["", "| fault | at s | recovered after s | detail |", "| --- | ---: | ---: | --- |"]
    for fault in faults.values():
        lines.append(f"| {fault.name} | {fault.at_s} | {fault.recovered_s} | {fault.detail.strip()} |")
    lines += [
        "",
        f"RSS of the whole cluster (launcher and every process under it): {rss[0]:,.0f} MiB before the "
        f"load, {rss[1]:,.0f} MiB after ({rss[1] - rss[0]:+,.0f} MiB).",
        f"Hostile burst: {burst.get('cases', 0)} requests, {burst.get('server errors', 0)} server errors.",
        f"New calls the gRPC door opened to continue generation streams that lost their replica (a stream "
        f"that meets no ready replica takes several): {burst.get('streams_continued', 0)}.",
        "",
    ]
    errors = sorted({e for row in table.values() for e in row["errors"]})
    if errors:
        lines += ["Failures seen:", "", *[f"- `{e}`" for e in errors], ""]
    lines += ["Checks: " + ("all passed" if not problems else "FAILED"), *[f"- {p}" for p in problems]]
    text = "\n".join(lines) + "\n"
    path.write_text(text, encoding="utf-8")
    return text


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            flags = Path("/proc/cpuinfo").read_text()
            extra = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f" {f}" in flags]
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores" + (f" ({', '.join(extra)})" if extra else "")
    return "unknown"
