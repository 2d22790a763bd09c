"""`python -m perf.bench.compare`: the served ensemble side by side with its limit and a naive server.

One run, one system at a time (a 2-core machine cannot host two without each slowing the
other), the same checked-in 16-token sentences and the same load generator throughout:

  a. limit: ONNX Runtime in-process, the encoder file and thread count Triton serves for
     --precision, at its best batch size; also tokenizer + encoder in one loop
     (perf/baselines/limit.py). Measured before and after the servers; the larger figure counts (noise
     only ever lowers a ceiling);
  b. naive: perf/baselines/naive_server.py (FastAPI + PyTorch FP32, one request at a time), driven by
     perf_analyzer over HTTP at --concurrency;
  c. Triton's text_embedding ensemble via perf_analyzer over gRPC and HTTP at --concurrency,
     and over gRPC at --batching-concurrency (16);
  d. the same server with dynamic batching switched off for text_encoder, at
     --batching-concurrency: the config (read back from the server, dynamic_batching removed)
     is loaded through the repository API, so Triton swaps the encoder in about a second
     without a restart and every other setting stays the same;
  e. P50 and P99 of Triton under Poisson arrivals at --rate-fraction (0.7) of its peak.

Prints a table and the ratios the issue's targets are written in (served / limit, served /
naive, batching on / off, P99 / P50), and writes perf_analyzer's CSV and log of every
measurement, summary.csv, ratios.csv, limit.csv and summary.md under
perf/results/compare-<UTC time>/. --time-budget bounds the whole run; a measurement that does
not stabilise is retried once with twice the requests per window while time allows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from perf.baselines import limit as limit_mod
from perf.lib import perf_analyzer as pa
from perf.lib import served as served_mod
from perf.lib.harness import (
    ENCODER,
    MODEL,
    RateSettings,
    Row,
    Run,
    disable_all_dynamic_batching,
    ensure_exported,
    measure,
    measure_served,
    new_run,
    rate_warnings,
    settings_for,
    skipped,
    write_csv,
)
from perf.lib.report import load_average
from perf.lib.stats import measured

# The targets, checked (not enforced) in the printed ratios.
TARGET_SERVED_VS_LIMIT = 0.85
TARGET_SERVED_VS_NAIVE = 5.0
TARGET_P99_OVER_P50 = 3.0


@dataclass
class Ratio:
    name: str
    value: float | None
    target: str = ""
    met: bool | None = None
    detail: str = ""


@dataclass
class CompareRun(Run):
    """A run of this tool: the in-process limits measured before and after the servers."""

    limits: dict[str, limit_mod.Limit] = field(default_factory=dict)  # "before"/"after" the servers
    limit_errors: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny request counts and a short limit measurement (CI smoke; figures are rough)"
    )
    p.add_argument("--concurrency", type=int, default=32, help="concurrency of naive vs Triton (default 32)")
    p.add_argument(
        "--batching-concurrency", type=int, default=16, help="concurrency of Triton with dynamic batching on vs off (default 16)"
    )
    p.add_argument(
        "--precision",
        default="cpu",
        help="what Triton serves and the limit runs, as `make serve PRECISION=`: cpu (default), fp32, ...",
    )
    p.add_argument(
        "--rate-fraction",
        type=float,
        default=0.7,
        help="Poisson request rate as a fraction of Triton's peak for P99 vs P50 (default 0.7; 0 = skip)",
    )
    p.add_argument("--time-budget", type=float, help="seconds for the whole run (default 900, --quick 150)")
    p.add_argument("--request-count", type=int, help="requests per measurement window (default 500, --quick 40)")
    p.add_argument("--stability-percent", type=float, help="perf_analyzer -s (default 30, --quick 100)")
    p.add_argument("--max-trials", type=int, help="windows before a measurement is unstable (default 6, --quick 3)")
    p.add_argument("--input-data", type=Path, default=served_mod.DEFAULT_INPUT, help="perf_analyzer input JSON")
    p.add_argument("--out-dir", type=Path, help="results folder (default perf/results/compare-<UTC time>)")
    p.add_argument("--no-export", action="store_true", help="never export, even when model files are missing")
    p.add_argument("--verbose", action="store_true", help="log perf_analyzer command lines")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    quick = args.quick
    defaults = dict(
        time_budget=150.0 if quick else 900.0,
        request_count=40 if quick else 500,
        stability_percent=100.0 if quick else 30.0,
        max_trials=3 if quick else 6,
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    # Per measurement; there are two, before and after the servers (the larger counts).
    args.limit_rounds, args.limit_seconds = (1, 0.3) if quick else (2, 1.0)
    args.limit_reserve_s = 10.0 if quick else 35.0  # what the closing one needs, set-up included
    args.limit_batches = (1, 16, 64) if quick else limit_mod.DEFAULT_BATCHES
    if min(args.concurrency, args.batching_concurrency, args.request_count, args.max_trials) < 1 or args.time_budget <= 0:
        p.error("--concurrency, --batching-concurrency, --request-count, --max-trials and --time-budget must be positive")
    if not 0 <= args.rate_fraction < 1:
        p.error("--rate-fraction must be in [0, 1)")
    if not args.input_data.is_file():
        p.error(f"input data {args.input_data} not found")
    return args


# --------------------------------------------------------------------------- the systems


def measure_limit(run: CompareRun, served: served_mod.ServedEncoder, when: str) -> None:
    """One in-process limit measurement (``when``: "before" or "after" the servers) into run.limits."""
    a = run.args
    run.say(
        f"(a) limit {when} the servers: ONNX Runtime in-process, {served.variant} ({served.model_path.name}), "
        f"layouts {', '.join(f'{n}x{t}' for n, t in limit_mod.layouts(served))} (sessions x threads)"
    )
    started = time.monotonic()
    try:
        result = limit_mod.measure(
            served,
            served_mod.load_sentences(a.input_data),
            a.limit_batches,
            rounds=a.limit_rounds,
            seconds=a.limit_seconds,
            progress=lambda m: run.say(f"    {m}"),
        )
    except Exception as exc:  # a broken export must not lose the served measurements
        run.say(f"    limit failed: {exc}")
        run.limit_errors.append(f"{when}: {exc}")
        return
    run.limits[when] = result
    run.say(
        f"    encoder {result.encoder.best_throughput:.0f} seq/s (batch {result.encoder.best_batch}, "
        f"{result.best_layout('encoder')}), end to end {result.end_to_end.best_throughput:.0f} seq/s "
        f"({time.monotonic() - started:.0f} s)"
    )


def add_limit_rows(run: CompareRun) -> None:
    """The limit rows: per kind, the larger of the before/after figures.

    A ceiling is a maximum: a busy neighbour can only lower an in-process figure, so the
    larger of two measurements bracketing the servers is the better estimate of what the
    machine can do (and the served / limit ratio the more demanding).
    """
    kinds = (
        ("limit_encoder", "limit: encoder alone (ONNX Runtime)", "encoder"),
        ("limit_e2e", "limit: tokenize + encode (pooling in the graph) in-process", "end_to_end"),
    )
    if not run.limits:
        reason = "failed: " + "; ".join(run.limit_errors) if run.limit_errors else "time budget used up"
        for key, system, _ in kinds:
            run.rows.insert(0 if key == "limit_encoder" else 1, skipped(key, system, "in-process", "best batch", reason))
        return
    records = []
    for position, (key, system, attr) in enumerate(kinds):
        speeds = {when: getattr(limit, attr) for when, limit in run.limits.items()}
        best_when = max(speeds, key=lambda w: speeds[w].best_throughput)
        speed = speeds[best_when]
        limit = run.limits[best_when]
        each = ", ".join(f"{w} {s.best_throughput:.0f}" for w, s in speeds.items())
        run.rows.insert(
            position,
            Row(
                key,
                system,
                "in-process",
                f"batch {speed.best_batch} (best)",
                speed.best_throughput,
                note=f"{limit.served.variant}, {limit.best_layout(attr)} sessions x threads; "
                f"{each}; batch-1 latency {speed.latency_ms_b1:.1f} ms",
            ),
        )
    for when, limit in run.limits.items():
        records += [{"when": when, **row} for row in limit.rows()]
    write_csv(run.out_dir / "limit.csv", records)


def measure_naive(run: Run, threads: int) -> None:
    from perf.baselines.naive_server import NaiveServer
    from server.process import free_port

    c = run.args.concurrency
    key, system, load = f"naive_http_c{c}", "naive: FastAPI + PyTorch FP32, no batching", f"concurrency {c}"
    if run.left() < 30:
        run.rows.append(skipped(key, system, "http", load, "time budget used up"))
        return
    server = NaiveServer(free_port(), run.out_dir / "naive_server.log", threads=threads)
    run.say(f"(b) naive server: starting on {server.http_url} ({threads} torch threads)")
    server.start()
    try:
        try:
            server.wait_ready(timeout=min(120.0, run.left()))
        except RuntimeError as exc:
            run.say(f"    {exc}")
            run.rows.append(skipped(key, system, "http", load, "server did not start"))
            return
        run.say(f"    perf_analyzer http, concurrency {c}")
        row = measure(run, Row(key, system, "http", load), settings_for(run, server.http_url, "http", c), steps_after=4)
        stats = row.measurement.server if row.measurement else None
        if stats and stats.breakdown_ms:
            b = stats.breakdown_ms
            row.note = (
                f"server: queue {b.get('queue', 0):.1f} ms, tokenize {b.get('compute input', 0):.1f} ms, "
                f"model {b.get('compute infer', 0):.1f} ms, pool {b.get('compute output', 0):.1f} ms"
            )
        run.rows.append(row)
    finally:
        server.stop()
        run.say("    naive server stopped")


def _encoder_note(row: Row) -> None:
    m = row.measurement
    stats = m.composing.get(ENCODER) if m else None
    if stats is not None and stats.avg_batch is not None:
        extra = (
            f"{ENCODER} mean batch {stats.avg_batch:.2f}, queue {stats.breakdown_ms.get('queue', 0):.1f} ms, "
            f"infer {stats.breakdown_ms.get('compute infer', 0):.1f} ms"
        )
        row.note = f"{row.note}; {extra}" if row.note else extra


def measure_triton(run: Run, served: served_mod.ServedEncoder) -> None:
    from perf.lib.deployment import server_deployment
    from server.process import ServerError

    a = run.args
    c, cb = a.concurrency, a.batching_concurrency
    system = f"Triton {MODEL} ({served.variant} encoder)"
    plan = [(f"triton_grpc_c{c}", "grpc", c), (f"triton_http_c{c}", "http", c)]
    if cb != c:
        plan.append((f"triton_grpc_c{cb}", "grpc", cb))
    rate_key = "triton_grpc_rate"
    off_key = f"triton_grpc_c{cb}_nobatch"
    off_system = f"Triton {MODEL} without dynamic batching (every step)"
    if run.left() < 30:
        for key, protocol, conc in plan:
            run.rows.append(skipped(key, system, protocol, f"concurrency {conc}", "time budget used up"))
        run.rows.append(skipped(off_key, off_system, "grpc", f"concurrency {cb}", "time budget used up"))
        return
    workdir = Path(tempfile.mkdtemp(prefix="perf-compare-"))
    server = server_deployment((MODEL,), workdir, model_config_name=served.config_name)
    run.say(f"(c) tritonserver: starting ({MODEL}, --model-config-name={served.config_name or '(none: FP32)'})")
    server.start()
    try:
        try:
            server.wait_ready(timeout=max(min(240.0, run.left()), 1.0))
        except ServerError as exc:
            run.say(f"    {exc}\n{exc.log_tail}")
            for key, protocol, conc in plan:
                run.rows.append(skipped(key, system, protocol, f"concurrency {conc}", "server did not start"))
            run.rows.append(skipped(off_key, off_system, "grpc", f"concurrency {cb}", "server did not start"))
            return
        steps_after = len(plan) + 1 + (1 if a.rate_fraction > 0 else 0)
        for key, protocol, conc in plan:
            steps_after -= 1
            url = server.grpc_url if protocol == "grpc" else server.http_url
            run.say(f"    perf_analyzer {protocol}, concurrency {conc}")
            row = measure_served(
                run,
                Row(key, system, protocol, f"concurrency {conc}"),
                settings_for(run, url, protocol, conc),
                steps_after,
                server.http_url,
            )
            _encoder_note(row)
            run.rows.append(row)

        if a.rate_fraction > 0:
            steps_after -= 1
            peak = max((measured(r.throughput) for r in run.rows if r.key.startswith("triton_grpc_c") and r.ok), default=None)
            if peak is None:
                run.rows.append(skipped(rate_key, system, "grpc", "Poisson", "no peak throughput measured"))
            else:
                rate = a.rate_fraction * peak
                load = f"Poisson {rate:.0f}/s ({a.rate_fraction:.0%} of {peak:.0f})"
                run.say(f"(e) perf_analyzer grpc, {load}")
                base = settings_for(run, server.grpc_url, "grpc", 1)
                settings = RateSettings(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, request_rate=rate)
                row = measure_served(run, Row(rate_key, system, "grpc", load), settings, steps_after, server.http_url)
                if row.ok:
                    row.note = f"achieved {row.throughput / rate:.0%} of the asked rate"
                    retry_log = run.out_dir / f"{rate_key}-retry.log"  # the retry's, when there was one
                    log_path = retry_log if retry_log.is_file() else run.out_dir / f"{rate_key}.log"
                    for warning in rate_warnings(log_path.read_text(errors="replace") if log_path.is_file() else ""):
                        row.note += f"; {warning}"
                    _encoder_note(row)
                run.rows.append(row)

        steps_after -= 1
        run.say("(d) switching dynamic batching off in every step (repository API, config override)")
        try:
            switched = disable_all_dynamic_batching(server.http_url)
            run.say(f"    reloaded without dynamic batching: {', '.join(switched)}")
        except (RuntimeError, OSError) as exc:
            run.say(f"    {exc}")
            run.rows.append(skipped(off_key, off_system, "grpc", f"concurrency {cb}", f"config swap failed: {exc}"))
        else:
            run.say(f"    perf_analyzer grpc, concurrency {cb}")
            row = measure_served(
                run,
                Row(off_key, off_system, "grpc", f"concurrency {cb}"),
                settings_for(run, server.grpc_url, "grpc", cb),
                steps_after,
                server.http_url,
            )
            _encoder_note(row)
            run.rows.append(row)
    finally:
        server.stop(logs_to=run.out_dir)
        shutil.rmtree(workdir, ignore_errors=True)
        run.say("    tritonserver stopped")


# --------------------------------------------------------------------------- ratios and report


def _row(rows: Sequence[Row], key: str) -> Row | None:
    return next((r for r in rows if r.key == key and r.ok), None)


def _ratio(name: str, num: Row | None, den: Row | None, target: float | None = None, above: bool = True) -> Ratio:
    if num is None or den is None or not den.throughput:
        return Ratio(name, None, "" if target is None else f"{'>=' if above else '<='} {target:g}", detail="not measured")
    value = measured(num.throughput) / den.throughput
    met = None if target is None else (value >= target if above else value <= target)
    return Ratio(
        name,
        value,
        "" if target is None else f"{'>=' if above else '<='} {target:g}",
        met,
        f"{num.throughput:.0f} / {den.throughput:.0f} infer/s",
    )


def ratios(args: argparse.Namespace, rows: Sequence[Row]) -> list[Ratio]:
    c, cb = args.concurrency, args.batching_concurrency
    grpc, http = _row(rows, f"triton_grpc_c{c}"), _row(rows, f"triton_http_c{c}")
    limit, e2e, naive = _row(rows, "limit_encoder"), _row(rows, "limit_e2e"), _row(rows, f"naive_http_c{c}")
    on = _row(rows, f"triton_grpc_c{cb}")
    out = [
        _ratio(f"served (gRPC, c{c}) / limit (encoder alone)", grpc, limit, TARGET_SERVED_VS_LIMIT),
        _ratio(f"served (HTTP, c{c}) / limit (encoder alone)", http, limit, TARGET_SERVED_VS_LIMIT),
        _ratio(f"served (gRPC, c{c}) / limit (tokenize+encode)", grpc, e2e),
        _ratio(f"served (HTTP, c{c}) / naive (HTTP, c{c})", http, naive, TARGET_SERVED_VS_NAIVE),
        _ratio(f"served (gRPC, c{c}) / naive (HTTP, c{c})", grpc, naive, TARGET_SERVED_VS_NAIVE),
        _ratio(f"dynamic batching on / off (gRPC, c{cb})", on, _row(rows, f"triton_grpc_c{cb}_nobatch")),
    ]
    rate = _row(rows, "triton_grpc_rate")
    if rate is not None and rate.p50_ms:
        value = measured(rate.p99_ms) / rate.p50_ms
        out.append(
            Ratio(
                f"P99 / P50 at {rate.load}",
                value,
                f"<= {TARGET_P99_OVER_P50:g}",
                value <= TARGET_P99_OVER_P50,
                f"{rate.p99_ms:.1f} / {rate.p50_ms:.1f} ms",
            )
        )
    else:
        out.append(
            Ratio(f"P99 / P50 at {args.rate_fraction:.0%} of peak", None, f"<= {TARGET_P99_OVER_P50:g}", detail="not measured")
        )
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(header: Sequence[str], rows: Sequence[Row], ratio_list: Sequence[Ratio]) -> str:
    lines = list(header) + [
        "",
        "| system | protocol | load | throughput (infer/s) | p50 (ms) | p99 (ms) | notes |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        tput = _fmt(r.throughput) if r.ok else f"failed: {r.error}"
        lines.append(f"| {r.system} | {r.protocol} | {r.load} | {tput} | {_fmt(r.p50_ms)} | {_fmt(r.p99_ms)} | {r.note} |")
    lines += ["", "| ratio | value | target | met | from |", "| --- | ---: | --- | --- | --- |"]
    for q in ratio_list:
        met = "" if q.met is None else ("yes" if q.met else "no")
        lines.append(f"| {q.name} | {_fmt(q.value, 2)} | {q.target} | {met} | {q.detail} |")
    breakdowns = [(r, r.measurement) for r in rows if r.measurement is not None and r.measurement.composing]
    if breakdowns:
        lines += [
            "",
            "Where the time goes, Triton measurements (mean ms per request; client side from "
            "perf_analyzer's CSV, server side from Triton's statistics over the whole perf_analyzer run, "
            "every model that served requests, BLS calls included; a step's compute is the whole "
            "execution its request was part of):",
            "",
            "| measurement | client send | network + server send/recv | client recv | ensemble queue | "
            "step | step queue | compute input | compute infer | compute output | mean batch |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r, m in breakdowns:
            client = (
                f"{_fmt(m.client_send_ms, 2)} | {_fmt(m.network_server_send_recv_ms, 2)} | "
                f"{_fmt(m.client_recv_ms, 2)} | {_fmt(m.server_queue_ms, 2)}"
            )
            for i, name in enumerate(sorted(m.composing, key=lambda n: (n != "text_tokenizer", n))):
                s = m.composing[name]
                b = s.breakdown_ms
                lead = f"| {r.key} | {client} |" if i == 0 else "| | | | | |"
                lines.append(
                    f"{lead} {name} | {_fmt(b.get('queue'))} | {_fmt(b.get('compute input'), 2)} | "
                    f"{_fmt(b.get('compute infer'))} | {_fmt(b.get('compute output'), 2)} | "
                    f"{_fmt(s.avg_batch, 2)} |"
                )
    return "\n".join(lines) + "\n"


def summary_records(rows: Sequence[Row]) -> list[dict[str, object]]:
    records = []
    for r in rows:
        record: dict[str, object] = {
            "key": r.key,
            "system": r.system,
            "protocol": r.protocol,
            "load": r.load,
            "throughput": r.throughput,
            "p50_ms": r.p50_ms,
            "p99_ms": r.p99_ms,
            "error": r.error,
            "note": r.note,
            "wall_s": round(r.wall_s, 1),
        }
        if r.measurement is not None:
            record.update({k: v for k, v in r.measurement.as_row().items() if k not in record})
        records.append(record)
    return records


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    state = new_run(args, "compare", CompareRun)
    if state is None:
        return 2
    out_dir = state.out_dir

    served = served_mod.served_encoder(args.precision)
    if not ensure_exported(served, args, state.say):
        return 1
    served = served_mod.served_encoder(args.precision)
    load = load_average()
    state.say(
        f"perf.bench.compare: precision {args.precision} -> {ENCODER} {served.variant}, "
        f"concurrency {args.concurrency}, batching on/off at {args.batching_concurrency}, budget {args.time_budget:.0f} s, load average {load}"
    )

    measure_limit(state, served, "before")
    measure_naive(state, served.threads * served.instances)
    measure_triton(state, served)
    if state.left() > args.limit_reserve_s:
        measure_limit(state, served, "after")
    else:
        state.say("(a) limit after the servers: skipped, time budget used up")
    add_limit_rows(state)

    ratio_list = ratios(args, state.rows)
    header = [
        f"# Side-by-side comparison: {MODEL}, precision {args.precision} ({ENCODER} {served.variant})",
        "",
        f"- {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before "
        f"measuring {load}; one system at a time",
        f"- command: `{' '.join(['python -m perf.bench.compare', *args.argv])}`",
        f"- input: {pa.display_path(args.input_data)}, 16-token sentences, batch size 1 per request",
        f"- perf_analyzer windows of {args.request_count} requests (count_windows), -s {args.stability_percent:g}, "
        f"max trials {args.max_trials}, one retry with twice the requests",
        f"- threads: Triton's encoder {served.instances} instance(s) x {served.threads} intra-op thread(s); the limit "
        f"the faster of that and 1 x {os.cpu_count()}; torch {served.threads * served.instances} (naive)",
    ]
    table = markdown(header, state.rows, ratio_list)
    (out_dir / "summary.md").write_text(table)
    write_csv(out_dir / "summary.csv", summary_records(state.rows))
    write_csv(out_dir / "ratios.csv", [dataclasses.asdict(q) for q in ratio_list])
    print("\n" + table, flush=True)
    state.say(f"perf.bench.compare: results in {pa.display_path(out_dir)}")
    return 0 if all(r.ok for r in state.rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S"
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
