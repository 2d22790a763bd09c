"""`python -m perf.bench.compare`: the served ensemble side by side with its limit and a naive server.

A sweep scenario (perf.lib.harness), one system at a time, the same 16-token sentences throughout:
the in-process limit (perf/baselines/limit.py, before and after the servers, the larger counts); the
naive server (perf/baselines/naive_server.py) at --concurrency; Triton's text_embedding over gRPC and
HTTP, and at --batching-concurrency with dynamic batching on and off (reloaded through the
repository API); Triton under Poisson arrivals at --rate-fraction of its peak (P99 / P50). Prints the
table and the ratios the targets are written in; writes perf_analyzer's CSVs and logs, summary.csv,
ratios.csv, limit.csv and summary.md under perf/results/compare-<UTC time>/.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from perf.baselines import limit as limit_mod
from perf.lib import harness, report
from perf.lib import served as served_mod
from perf.lib.harness import ENCODER, MODEL, Row, Run
from perf.lib.stats import measured

# The targets, checked (not enforced) in the printed ratios.
TARGET_SERVED_VS_LIMIT = 0.85
TARGET_SERVED_VS_NAIVE = 5.0
TARGET_P99_OVER_P50 = 3.0


@dataclass
class CompareRun(Run):
    """A run of this tool: the in-process limits measured before and after the servers."""

    limits: dict[str, limit_mod.Limit] = field(default_factory=dict)  # "before"/"after" the servers
    limit_errors: list[str] = field(default_factory=list)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    quick = "tiny request counts and a short limit measurement (CI smoke; figures are rough)"
    p = harness.parser("compare", __doc__, quick, time_budget=(900.0, 150.0), request_count=(500, 40))
    p.add_argument("--concurrency", type=int, default=32, help="concurrency of naive vs Triton (default 32)")
    p.add_argument("--batching-concurrency", type=int, default=16, help="of Triton with dynamic batching on vs off (default 16)")
    p.add_argument(
        "--rate-fraction", type=float, default=0.7, help="Poisson rate for P99 / P50, of Triton's peak (default 0.7; 0 = skip)"
    )
    args = harness.parse(p, argv)
    # Per limit measurement; there are two, before and after the servers (the larger counts).
    args.limit_rounds, args.limit_seconds = (1, 0.3) if args.quick else (2, 1.0)
    args.limit_reserve_s = 10.0 if args.quick else 35.0  # what the closing one needs, set-up included
    args.limit_batches = (1, 16, 64) if args.quick else limit_mod.DEFAULT_BATCHES
    if min(args.concurrency, args.batching_concurrency) < 1:
        p.error("--concurrency and --batching-concurrency must be positive")
    if not 0 <= args.rate_fraction < 1:
        p.error("--rate-fraction must be in [0, 1)")
    return args


def measure_limit(run: CompareRun, served: served_mod.ServedEncoder, when: str) -> None:
    """One in-process limit measurement (``when``: "before" or "after" the servers) into run.limits."""
    a = run.args
    layouts = ", ".join(f"{n}x{t}" for n, t in limit_mod.layouts(served))
    run.say(f"(a) limit {when} the servers: {served.variant} ({served.model_path.name}), layouts {layouts} (sessions x threads)")
    started = time.monotonic()
    texts = served_mod.load_sentences(a.input_data)
    try:
        result = limit_mod.measure(
            served, texts, a.limit_batches, rounds=a.limit_rounds, seconds=a.limit_seconds, progress=lambda m: run.say(f"    {m}")
        )
    except Exception as exc:  # a broken export must not lose the served measurements
        run.say(f"    limit failed: {exc}")
        run.limit_errors.append(f"{when}: {exc}")
        return
    run.limits[when] = result
    run.say(
        f"    encoder {result.encoder.best_throughput:.0f} seq/s (batch {result.encoder.best_batch}, {result.best_layout('encoder')}), "
        f"end to end {result.end_to_end.best_throughput:.0f} seq/s ({time.monotonic() - started:.0f} s)"
    )


def add_limit_rows(run: CompareRun) -> None:
    """Per kind, the larger of the before/after figures: a busy neighbour can only lower an in-process
    figure, so the larger of two measurements bracketing the servers is the better estimate."""
    kinds = (
        ("limit_encoder", "limit: encoder alone (ONNX Runtime)", "encoder"),
        ("limit_e2e", "limit: tokenize + encode (pooling in the graph) in-process", "end_to_end"),
    )
    reason = "failed: " + "; ".join(run.limit_errors) if run.limit_errors else "time budget used up"
    for position, (key, system, attr) in enumerate(kinds):
        if not run.limits:
            run.rows.insert(position, Row(key, system, "in-process", "best batch", error=reason))
            continue
        speeds = {when: getattr(limit, attr) for when, limit in run.limits.items()}
        best_when = max(speeds, key=lambda w: speeds[w].best_throughput)
        speed, limit = speeds[best_when], run.limits[best_when]
        each = ", ".join(f"{w} {s.best_throughput:.0f}" for w, s in speeds.items())
        note = f"{limit.served.variant}, {limit.best_layout(attr)} sessions x threads; {each}; batch-1 latency {speed.latency_ms_b1:.1f} ms"
        load = f"batch {speed.best_batch} (best)"
        run.rows.insert(position, Row(key, system, "in-process", load, speed.best_throughput, note=note, kind="in-process"))
    if run.limits:
        harness.write_csv(run.out_dir / "limit.csv", [{"when": w, **r} for w, limit in run.limits.items() for r in limit.rows()])


def measure_naive(run: Run, threads: int) -> None:
    from perf.baselines.naive_server import NaiveServer
    from server.process import free_port

    c = run.args.concurrency
    row = Row(f"naive_http_c{c}", "naive: FastAPI + PyTorch FP32, no batching", "http", f"concurrency {c}")
    if run.left() < 30:
        run.rows.append(dataclasses.replace(row, error="time budget used up"))
        return
    server = NaiveServer(free_port(), run.out_dir / "naive_server.log", threads=threads)
    run.say(f"(b) naive server: starting on {server.http_url} ({threads} torch threads)")
    try:
        server.start().wait_ready(timeout=min(120.0, run.left()))
    except RuntimeError as exc:
        run.say(f"    {exc}")
        row.error = "server did not start"
    else:
        run.say(f"    perf_analyzer http, concurrency {c}")
        harness.point(run, row, server.http_url, concurrency=c, steps_after=4, stats_url=server.http_url)
        stats = row.measurement.server if row.measurement else None
        if stats and stats.breakdown_ms:
            b = stats.breakdown_ms
            row.note = (
                f"server: queue {b.get('queue', 0):.1f} ms, tokenize {b.get('compute input', 0):.1f} ms, "
                f"model {b.get('compute infer', 0):.1f} ms, pool {b.get('compute output', 0):.1f} ms"
            )
    finally:
        server.stop()
        run.say("    naive server stopped")
    run.rows.append(row)


def measure_triton(run: Run, served: served_mod.ServedEncoder) -> None:
    from server.process import ServerError

    a = run.args
    c, cb = a.concurrency, a.batching_concurrency
    system = f"Triton {MODEL} ({served.variant} encoder)"
    plan = [(f"triton_grpc_c{c}", "grpc", c), (f"triton_http_c{c}", "http", c)] + (
        [(f"triton_grpc_c{cb}", "grpc", cb)] if cb != c else []
    )
    off = Row(f"triton_grpc_c{cb}_nobatch", f"Triton {MODEL} without dynamic batching (every step)", "grpc", f"concurrency {cb}")
    if run.left() < 30:
        run.rows += [Row(key, system, protocol, f"concurrency {n}", error="time budget used up") for key, protocol, n in plan]
        run.rows.append(dataclasses.replace(off, error="time budget used up"))
        return
    try:
        with harness.triton(run, (MODEL,), served.config_name) as server:
            steps_after = len(plan) + 1 + (1 if a.rate_fraction > 0 else 0)
            for key, protocol, conc in plan:
                steps_after -= 1
                run.say(f"(c) perf_analyzer {protocol}, concurrency {conc}")
                url = server.grpc_url if protocol == "grpc" else server.http_url
                row = Row(key, system, protocol, f"concurrency {conc}")
                run.rows.append(
                    harness.point(run, row, url, concurrency=conc, steps_after=steps_after, stats_url=server.http_url)
                )
            if a.rate_fraction > 0:
                steps_after -= 1
                peak = max((measured(r.throughput) for r in run.rows if r.key.startswith("triton_grpc_c") and r.ok), default=None)
                if peak is None:
                    run.rows.append(Row("triton_grpc_rate", system, "grpc", "Poisson", error="no peak throughput measured"))
                else:
                    rate = a.rate_fraction * peak
                    row = Row("triton_grpc_rate", system, "grpc", f"Poisson {rate:.0f}/s ({a.rate_fraction:.0%} of {peak:.0f})")
                    run.say(f"(e) perf_analyzer grpc, {row.load}")
                    run.rows.append(
                        harness.point(run, row, server.grpc_url, rate=rate, steps_after=steps_after, stats_url=server.http_url)
                    )
            run.say("(d) switching dynamic batching off in every step (repository API, config override)")
            try:
                run.say(
                    f"    reloaded without dynamic batching: {', '.join(harness.disable_all_dynamic_batching(server.http_url))}"
                )
            except (RuntimeError, OSError) as exc:
                run.say(f"    {exc}")
                off.error = f"config swap failed: {exc}"
            else:
                run.say(f"    perf_analyzer grpc, concurrency {cb}")
                harness.point(run, off, server.grpc_url, concurrency=cb, stats_url=server.http_url)
            run.rows.append(off)
    except ServerError as exc:
        run.say(f"    {exc}\n{exc.log_tail}")
        run.rows += [Row(key, system, protocol, f"concurrency {n}", error="server did not start") for key, protocol, n in plan]
        run.rows.append(dataclasses.replace(off, error="server did not start"))


def ratios(args: argparse.Namespace, rows: Sequence[Row]) -> list[dict]:
    def row(key: str) -> Row | None:
        return next((r for r in rows if r.key == key and r.ok), None)

    def ratio(name: str, num: Row | None, den: Row | None, target: float | None = None) -> dict:
        return report.ratio(name, num and num.throughput, den and den.throughput, target, digits=0, unit=" infer/s")

    c, cb = args.concurrency, args.batching_concurrency
    grpc, http, naive = row(f"triton_grpc_c{c}"), row(f"triton_http_c{c}"), row(f"naive_http_c{c}")
    rate = row("triton_grpc_rate")
    at = rate.load if rate is not None else f"{args.rate_fraction:.0%} of peak"
    return [
        ratio(f"served (gRPC, c{c}) / limit (encoder alone)", grpc, row("limit_encoder"), TARGET_SERVED_VS_LIMIT),
        ratio(f"served (HTTP, c{c}) / limit (encoder alone)", http, row("limit_encoder"), TARGET_SERVED_VS_LIMIT),
        ratio(f"served (gRPC, c{c}) / limit (tokenize+encode)", grpc, row("limit_e2e")),
        ratio(f"served (HTTP, c{c}) / naive (HTTP, c{c})", http, naive, TARGET_SERVED_VS_NAIVE),
        ratio(f"served (gRPC, c{c}) / naive (HTTP, c{c})", grpc, naive, TARGET_SERVED_VS_NAIVE),
        ratio(f"dynamic batching on / off (gRPC, c{cb})", row(f"triton_grpc_c{cb}"), row(f"triton_grpc_c{cb}_nobatch")),
        report.ratio(f"P99 / P50 at {at}", rate and rate.p99_ms, rate and rate.p50_ms, TARGET_P99_OVER_P50, False, unit=" ms"),
    ]


def markdown(head: Sequence[str], rows: Sequence[Row], ratio_list: Sequence[dict]) -> list[str]:
    return [*head, "", *harness.table(rows), "", report.ratio_table(ratio_list), *harness.breakdown(rows)]


def run(args: argparse.Namespace) -> int:
    state = harness.new_run(args, "compare", CompareRun)
    if state is None:
        return 2
    served = served_mod.served_encoder(args.precision)
    tokenizer = served_mod.REPOSITORY / served_mod.TOKENIZER / "1" / "tokenizer.json"
    if not harness.ensure_exported(args, state.say, [ENCODER], [served.model_path, tokenizer]):
        return 1
    served = served_mod.served_encoder(args.precision)
    load = report.load_average()
    state.say(
        f"perf.bench.compare: precision {args.precision} -> {ENCODER} {served.variant}, concurrency {args.concurrency}, "
        f"batching on/off at {args.batching_concurrency}, budget {args.time_budget:.0f} s, load average {load}"
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
    head = harness.header(
        f"Side-by-side comparison: {MODEL}, precision {args.precision} ({ENCODER} {served.variant})",
        args,
        "compare",
        load,
        f"input: {report.display_path(args.input_data)}, 16-token sentences, batch size 1 per request; one system at a time",
        f"perf_analyzer windows of {args.request_count} requests (count_windows), -s {args.stability_percent:g}, "
        f"max trials {args.max_trials}, one retry with twice the requests",
        f"threads: Triton's encoder {served.instances} instance(s) x {served.threads} intra-op thread(s); the limit "
        f"the faster of that and 1 x {os.cpu_count()}; torch {served.threads * served.instances} (naive)",
    )
    harness.finish(state, "compare", markdown(head, state.rows, ratio_list), "summary.csv", [r.record() for r in state.rows])
    harness.write_csv(state.out_dir / "ratios.csv", ratio_list)
    return 0 if all(r.ok for r in state.rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
