"""What a benchmark's report is made of: its results folder (``--out-dir`` or perf/results/<kind>-<UTC
time>), what it writes there (summary.md, results.json with the raw figures where it has them, its
CSV files), the way a figure is printed and its markdown tables."""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from perf.lib.paths import RESULTS, ROOT

STAMP = "%Y%m%d-%H%M%S"


def results_dir(out_dir: Path | None, kind: str, stamp: str = STAMP) -> Path:
    """``out_dir``, else perf/results/<kind>-<UTC time as ``stamp``>; created."""
    path = out_dir or RESULTS / f"{kind}-{dt.datetime.now(dt.UTC).strftime(stamp)}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write(
    out_dir: Path,
    summary: str,
    data: object | None = None,
    name: str = "summary.md",
    csvs: Mapping[str, Sequence[Mapping[str, object]]] | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """``summary`` (markdown) as ``out_dir/name``, ``data`` (when given) as out_dir/results.json and each of
    ``csvs`` (file name -> records; none written for no records) as CSV; with ``say``, the summary printed
    and the folder said."""
    path = out_dir / name
    path.write_text(summary)
    if data is not None:
        (out_dir / "results.json").write_text(json.dumps(data, indent=2, default=str))
    for csv_name, records in (csvs or {}).items():
        if records:
            write_csv(out_dir / csv_name, records)
    if say is not None:
        print("\n" + summary, flush=True)
        say(f"results in {display_path(out_dir)}")
    return path


def write_csv(path: Path, records: Sequence[Mapping[str, object]]) -> None:
    """``records`` as CSV, the columns every record's keys in the order first seen."""
    columns: list[str] = []
    for record in records:
        columns += [k for k in record if k not in columns]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)


def display_path(path: Path) -> str:
    """A results path as the perf tools print it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def fmt(value: float | None, digits: int = 1, missing: str = "", thousands: bool = False) -> str:
    """A figure with ``digits`` decimals (``thousands``: with a comma every three digits); ``missing`` for None."""
    if value is None:
        return missing
    return f"{value:,.{digits}f}" if thousands else f"{value:.{digits}f}"


def header(title: str, prog: str, argv: Sequence[str], load_before: str) -> list[str]:
    """A summary's first lines: its title, when and on what it ran (CPUs, load average before and
    after) and the command (``python -m <prog> <argv>``)."""
    return [
        f"# {title}",
        "",
        f"- {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before {load_before}, "
        f"after {load_average()}",
        f"- command: `{' '.join([f'python -m {prog}', *argv])}`",
    ]


def table(header: Sequence[str], rows: Iterable[Sequence[object]], left: int = 1) -> str:
    """A markdown table: the first ``left`` columns aligned left, the others right (figures)."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    lines = [header, align, *([str(c) for c in row] for row in rows)]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def ratio(
    name: str, a, b, target: float | None = None, above: bool = True, op: str = "/", digits: int = 1, unit: str = ""
) -> dict:
    """A row of a ratios table: a / b (or a - b: ``op`` "-"), whether it meets ``target`` (>= it, or <= it
    unless ``above``; None: no target), and its terms (in ``unit``)."""
    if op == "-":
        value = round(a - b, 1) if a is not None and b is not None else None
    else:
        value = round(a / b, 3) if a and b else None
    met = "" if value is None or target is None else ("yes" if (value >= target if above else value <= target) else "no")
    terms = "not measured" if value is None else f"{fmt(a, digits, thousands=True)} {op} {fmt(b, digits, thousands=True)}{unit}"
    goal = "" if target is None else f"{'>=' if above else '<='} {target:g}"
    return {"name": name, "value": value, "target": goal, "met": met, "detail": terms}


def ratio_table(rows: Iterable[dict]) -> str:
    """The ratios table of ``ratio`` rows."""
    cells = ([r["name"], fmt(r["value"], 3, missing="-"), r["target"], r["met"], r["detail"]] for r in rows)
    return table(["ratio", "value", "target", "met", "from"], cells)


def progress(started: float | None = None) -> Callable[[str], None]:
    """A progress printer for a run: each line led by the seconds since ``started`` (default: now)."""
    origin = time.monotonic() if started is None else started

    def say(message: str) -> None:
        print(f"[{time.monotonic() - origin:5.0f} s] {message}", flush=True)

    return say


def cpu_model() -> str:
    """The CPU's model name and cores, with the vector extensions inference uses."""
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "unknown")
    extra = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f" {f}" in info]
    return f"{name}, {os.cpu_count()} cores" + (f" ({', '.join(extra)})" if extra else "")


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages, as the reports print them (2-core machines are shared)."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())
