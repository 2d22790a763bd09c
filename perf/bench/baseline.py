"""`python -m perf.bench.baseline`: throughput and latency of the text_embedding ensemble.

Runs perf_analyzer once per concurrency level (default 1 and 16) with the checked-in
16-token sentences, over gRPC by default. Without --url it exports what is missing, starts
its own tritonserver on free ports and stops it afterwards; with --url it measures that
server. Prints a markdown table and writes, under perf/results/baseline-<UTC time>/:
perf_analyzer's CSV and text output per level, summary.csv (all figures) and summary.md.

The whole run is bounded by --time-budget: each level gets what is left of it, and a level
that does not stabilise is retried once with twice the requests per window if time allows.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from perf.lib import perf_analyzer as pa
from perf.lib.harness import int_list
from perf.lib.paths import RESULTS as DEFAULT_RESULTS
from perf.lib.paths import SENTENCES_16TOK as DEFAULT_INPUT
from perf.lib.report import load_average

MODEL = "text_embedding"


@dataclass
class Level:
    """The outcome of one concurrency level: a measurement or the reason there is none."""

    concurrency: int
    measurement: pa.Measurement | None = None
    error: str = ""
    wall_s: float = 0.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.baseline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="host:port of a running server's endpoint for --protocol (default: start one)")
    p.add_argument("--protocol", choices=pa.PROTOCOLS, default="grpc")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--concurrency", type=int_list, default=[1, 16], help="comma-separated levels (default 1,16)")
    p.add_argument("--request-count", type=int, default=400, help="requests per measurement window (default 400)")
    p.add_argument("--stability-percent", type=float, default=30.0, help="perf_analyzer -s (default 30)")
    p.add_argument("--max-trials", type=int, default=6, help="windows before a level counts as unstable (default 6)")
    p.add_argument("--input-data", type=Path, default=DEFAULT_INPUT, help="perf_analyzer input JSON")
    p.add_argument("--time-budget", type=float, default=600.0, help="seconds for the whole run, server start included")
    p.add_argument("--out-dir", type=Path, help="results folder (default perf/results/baseline-<UTC time>)")
    p.add_argument("--no-export", action="store_true", help="do not export missing models before starting a server")
    p.add_argument("--verbose", action="store_true", help="log perf_analyzer command lines")
    args = p.parse_args(argv)
    if args.request_count < 1 or args.max_trials < 1 or args.time_budget <= 0:
        p.error("--request-count, --max-trials and --time-budget must be positive")
    if not args.input_data.is_file():
        p.error(f"input data {args.input_data} not found")
    return args


def say(message: str) -> None:
    print(message, flush=True)


def measure_level(
    concurrency: int, args: argparse.Namespace, url: str, out_dir: Path, deadline: float, binary: Path, env: dict
) -> Level:
    """One level with at most one retry (twice the requests per window) when it does not stabilise."""
    level = Level(concurrency)
    started = time.monotonic()
    request_count = args.request_count
    for attempt in (1, 2):
        left = deadline - time.monotonic()
        if left < 5:
            level.error = "time budget used up"
            break
        settings = pa.Settings(
            model=args.model,
            url=url,
            protocol=args.protocol,
            concurrency=concurrency,
            input_data=args.input_data,
            request_count=request_count,
            stability_percent=args.stability_percent,
            max_trials=args.max_trials,
            timeout_s=left,
        )
        stem = f"c{concurrency}" if attempt == 1 else f"c{concurrency}-retry"
        try:
            level.measurement = pa.measure(
                settings, out_dir / f"{stem}.csv", log_path=out_dir / f"{stem}.log", binary=binary, env=env
            )
            level.error = ""
            break
        except pa.PerfAnalyzerUnstable as exc:
            level.error = "unstable"
            say(f"    {exc}")
            request_count *= 2
            if attempt == 1:
                say(f"    retrying with {request_count} requests per window")
        except pa.PerfAnalyzerTimeout as exc:
            level.error = "timed out"
            say(f"    {exc}")
            break
        except pa.PerfAnalyzerError as exc:
            level.error = str(exc).splitlines()[0]
            say(f"    {exc}\n{exc.output_tail(15)}")
            break
    level.wall_s = time.monotonic() - started
    return level


def _fmt(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(levels: Sequence[Level], header: Sequence[str]) -> str:
    lines = list(header) + [
        "",
        "| concurrency | throughput (infer/s) | p50 (ms) | p99 (ms) |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for level in levels:
        m = level.measurement
        if m is None:
            lines.append(f"| {level.concurrency} | failed: {level.error} | | |")
        else:
            lines.append(f"| {level.concurrency} | {m.throughput:.1f} | {m.p50_ms:.1f} | {m.p99_ms:.1f} |")
    steps = sorted({name for level in levels if level.measurement for name in level.measurement.composing})
    if steps:
        lines += [
            "",
            "Server side, per ensemble step (mean queue and compute ms, mean batch = inferences per execution):",
            "",
            "| concurrency | step | queue (ms) | compute infer (ms) | mean batch |",
            "| ---: | --- | ---: | ---: | ---: |",
        ]
        for level in levels:
            if level.measurement is None:
                continue
            for name in steps:
                s = level.measurement.composing.get(name)
                if s is not None:
                    lines.append(
                        f"| {level.concurrency} | {name} | {_fmt(s.breakdown_ms.get('queue'))} | "
                        f"{_fmt(s.breakdown_ms.get('compute infer'))} | {_fmt(s.avg_batch, 2)} |"
                    )
    return "\n".join(lines) + "\n"


def write_summary_csv(path: Path, levels: Sequence[Level], protocol: str) -> None:
    rows = []
    for level in levels:
        row: dict[str, object] = {"protocol": protocol, "concurrency": level.concurrency, "error": level.error}
        if level.measurement is not None:
            row.update(level.measurement.as_row())
        row["wall_s"] = round(level.wall_s, 1)
        rows.append(row)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def run(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.time_budget
    try:
        binary, env = pa.check()
    except pa.PerfAnalyzerNotAvailable as exc:
        say(f"perf.bench.baseline: {exc}")
        return 2
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or DEFAULT_RESULTS / f"baseline-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)

    server = None
    url = args.url
    try:
        if url is None:
            server, url = start_server(args, deadline)
            if server is None:
                return 1
        load = load_average()
        say(f"perf.bench.baseline: {args.model} over {args.protocol} at {url}, concurrency {args.concurrency}")
        levels = []
        for i, concurrency in enumerate(args.concurrency, start=1):
            say(f"[{i}/{len(args.concurrency)}] concurrency {concurrency} ({deadline - time.monotonic():.0f} s of budget left)")
            level = measure_level(concurrency, args, url, out_dir, deadline, binary, env)
            if level.measurement is not None:
                m = level.measurement
                say(f"    {m.throughput:.1f} infer/s, p50 {m.p50_ms:.1f} ms, p99 {m.p99_ms:.1f} ms ({level.wall_s:.0f} s)")
            levels.append(level)
    finally:
        if server is not None:
            say("perf.bench.baseline: stopping tritonserver")
            server.stop()

    header = [
        f"# {args.model} baseline, perf_analyzer over {args.protocol}",
        "",
        f"- {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before measuring {load}",
        f"- server: {'started by perf.bench.baseline (local tritonserver)' if args.url is None else args.url}",
        f"- input: {pa.display_path(args.input_data)}, batch size 1",
        f"- windows of {args.request_count} requests (count_windows), -s {args.stability_percent:g}, "
        f"max trials {args.max_trials}",
    ]
    table = markdown(levels, header)
    (out_dir / "summary.md").write_text(table)
    write_summary_csv(out_dir / "summary.csv", levels, args.protocol)
    say("\n" + table)
    say(f"perf.bench.baseline: results in {pa.display_path(out_dir)}")
    return 0 if all(level.measurement is not None for level in levels) else 1


def start_server(args: argparse.Namespace, deadline: float):
    """Export if needed, start a tritonserver on free ports; (server, url) or (None, None) after a failure."""
    from perf.lib.deployment import server_deployment
    from server.process import ServerError

    if not args.no_export:
        from export import __main__ as export_main

        if export_main.main([]) != 0:
            say("perf.bench.baseline: export failed")
            return None, None
    workdir = Path(tempfile.mkdtemp(prefix="perf-baseline-"))
    server = server_deployment((args.model,), workdir)
    say(f"perf.bench.baseline: starting tritonserver (log {server.triton.log_path})")
    server.start()
    try:
        server.wait_ready(timeout=max(deadline - time.monotonic(), 1.0))
    except ServerError as exc:
        server.stop()
        say(f"perf.bench.baseline: {exc}\n{exc.log_tail}")
        return None, None
    except BaseException:
        server.stop()
        raise
    return server, server.grpc_url if args.protocol == "grpc" else server.http_url


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(message)s",
        datefmt="%H:%M:%S",
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
