"""`python -m perf.bench.trace_report`: where the slow requests spend their time, from a Triton trace.

Starts a tritonserver serving ``text_embedding`` with request tracing on for every request
(``--trace-config level=TIMESTAMPS rate=1``), drives it with perf_analyzer (a concurrency or
a Poisson rate), then reads the trace: for the median requests and for the slowest 1 %, the
mean queue and compute time in each model (ensemble steps and BLS calls alike), and, per
model, its executions' durations and the longest gaps between consecutive executions while
it had requests queued: where a stall shows (docs/performance.md). ``--trace-file`` analyses an
existing trace instead of running one.

  python -m perf.bench.trace_report                      # concurrency 22, 3000 requests
  python -m perf.bench.trace_report --rate 400           # Poisson arrivals at 400/s
  python -m perf.bench.trace_report --encoder-layout 1x2 # the encoder as 1 instance x 2 threads
  python -m perf.bench.trace_report --trace-file trace.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from perf.lib import options, report
from perf.lib.report import table
from perf.lib.stats import percentile

MODEL = "text_embedding"


@dataclass
class Span:
    """One traced request of one model (an ensemble request, a step, or a BLS call)."""

    trace_id: int
    model: str
    version: str
    parent_id: int | None
    ts: dict[str, int] = field(default_factory=dict)  # timestamp name -> ns

    def ms(self, start: str, end: str) -> float | None:
        if start in self.ts and end in self.ts:
            return (self.ts[end] - self.ts[start]) / 1e6
        return None


def load(path: Path) -> dict[int, Span]:
    """Triton's trace file (a JSON list of partial records) as spans by trace id."""
    spans: dict[int, Span] = {}
    for record in json.loads(Path(path).read_text()):
        tid = record["id"]
        span = spans.get(tid)
        if span is None:
            span = spans[tid] = Span(
                tid, record.get("model_name", ""), str(record.get("model_version", "")), record.get("parent_id")
            )
        if "model_name" in record:
            span.model = record["model_name"]
        if record.get("parent_id"):
            span.parent_id = record["parent_id"]
        for ts in record.get("timestamps", []):
            span.ts[ts["name"]] = int(ts["ns"])
    return spans


def _descendants(spans: dict[int, Span]) -> dict[int, list[Span]]:
    children: dict[int, list[Span]] = collections.defaultdict(list)
    for s in spans.values():
        if s.parent_id:
            children[s.parent_id].append(s)
    out: dict[int, list[Span]] = {}

    def walk(tid: int) -> list[Span]:
        found = []
        for c in children.get(tid, []):
            found.append(c)
            found += walk(c.trace_id)
        return found

    for s in spans.values():
        if not s.parent_id:
            out[s.trace_id] = walk(s.trace_id)
    return out


@dataclass
class Report:
    requests: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    median_parts: dict[str, float]
    slowest_parts: dict[str, float]
    executions: dict[str, dict[str, float]]  # model -> median/max ms, count, max gap
    gaps: dict[str, list[float]]  # model -> the longest idle gaps with requests waiting, ms


def analyse(spans: dict[int, Span], model: str = MODEL) -> Report:
    tree = _descendants(spans)
    tops = [s for s in spans.values() if not s.parent_id and s.model == model and s.ms("REQUEST_START", "REQUEST_END")]
    if not tops:
        raise ValueError(f"no complete {model} request in the trace")

    def total_ms(top: Span) -> float:
        ms = top.ms("REQUEST_START", "REQUEST_END")
        assert ms is not None  # tops are the requests with both timestamps
        return ms

    tops.sort(key=total_ms)
    totals = [total_ms(s) for s in tops]
    n = len(tops)

    def parts(group: Sequence[Span]) -> dict[str, float]:
        sums: dict[str, list[float]] = collections.defaultdict(list)
        for top in group:
            per: dict[str, float] = collections.defaultdict(float)
            for child in tree.get(top.trace_id, []):
                q, c = child.ms("QUEUE_START", "COMPUTE_START"), child.ms("COMPUTE_START", "COMPUTE_END")
                if q is not None:
                    per[f"{child.model} queue"] += q
                if c is not None:
                    per[f"{child.model} compute"] += c
            per["total"] = total_ms(top)
            for k, v in per.items():
                sums[k].append(v)
        return {k: statistics.mean(v) for k, v in sorted(sums.items())}

    middle = tops[max(0, n // 2 - 20) : n // 2 + 20]
    slowest = tops[int(n * 0.99) :] or tops[-1:]

    executions: dict[str, dict[str, float]] = {}
    gaps: dict[str, list[float]] = {}
    by_model: dict[str, list[Span]] = collections.defaultdict(list)
    for s in spans.values():
        if s.parent_id and "COMPUTE_START" in s.ts and "COMPUTE_END" in s.ts:
            by_model[s.model].append(s)
    for name, group in by_model.items():
        first_queued: dict[tuple[int, int], int] = {}
        for s in group:
            run = (s.ts["COMPUTE_START"], s.ts["COMPUTE_END"])
            first_queued[run] = min(first_queued.get(run, run[0]), s.ts.get("QUEUE_START", run[0]))
        runs = sorted(first_queued)
        durations = [(e - b) / 1e6 for b, e in runs]
        # Idle with work waiting: no execution of the model ran while the first request of the
        # next execution was already in its queue.
        idle, busy_until = [], None
        for b, e in runs:
            if busy_until is not None and b > busy_until:
                waited_from = max(busy_until, first_queued[(b, e)])
                if waited_from < b:
                    idle.append((b - waited_from) / 1e6)
            busy_until = e if busy_until is None else max(busy_until, e)
        executions[name] = {
            "executions": len(runs),
            "median_ms": statistics.median(durations),
            "max_ms": max(durations),
            "max_gap_ms": max(idle, default=0.0),
        }
        gaps[name] = sorted(idle)[-5:]
    return Report(
        n,
        percentile(totals, 50),
        percentile(totals, 99),
        totals[-1],
        parts(middle),
        parts(slowest),
        executions,
        gaps,
    )


def markdown(r: Report) -> str:
    keys = sorted(set(r.median_parts) | set(r.slowest_parts), key=lambda k: (k == "total", k))
    parts = [(k, f"{r.median_parts.get(k, 0.0):.1f}", f"{r.slowest_parts.get(k, 0.0):.1f}") for k in keys]
    runs = [
        (name, f"{e['executions']:.0f}", f"{e['median_ms']:.1f}", f"{e['max_ms']:.1f}", f"{e['max_gap_ms']:.1f}")
        for name, e in sorted(r.executions.items())
    ]
    columns = ["model", "executions", "median execution (ms)", "longest execution (ms)"]
    return (
        f"{r.requests} traced requests: p50 {r.p50_ms:.1f} ms, p99 {r.p99_ms:.1f} ms, max {r.max_ms:.1f} ms.\n\n"
        + table(["mean ms per request", "median requests", "slowest 1 %"], parts)
        + "\n\n"
        + table([*columns, "longest idle gap with requests queued (ms)"], runs)
        + "\n"
    )


def _run_traced(args: argparse.Namespace, trace_path: Path) -> None:
    from perf.lib import harness
    from perf.lib import perf_analyzer as pa
    from perf.lib import served as served_mod
    from perf.lib.deployment import server_deployment

    served = served_mod.served_encoder(args.precision)
    extra = (
        f"--trace-config=triton,file={trace_path}",
        "--trace-config=rate=1",
        "--trace-config=level=TIMESTAMPS",
        "--trace-config=count=-1",
    )
    workdir = Path(tempfile.mkdtemp(prefix="perf-trace-"))
    server = server_deployment((MODEL,), workdir, model_config_name=served.config_name, extra_args=extra)
    server.start()
    try:
        server.wait_ready(timeout=240)
        if args.encoder_layout:
            from ops.repository import RepositoryClient
            from perf.bench import autotune

            instances, threads = args.encoder_layout
            config = RepositoryClient(server.http_url).config(harness.ENCODER)
            batching = config.get("dynamic_batching", {})
            delay, preferred = (
                int(batching.get("max_queue_delay_microseconds", 0)),
                (batching.get("preferred_batch_size") or [0])[0],
            )
            candidate = autotune.Candidate(delay, int(preferred), instances, threads)
            harness.reload_with(server.http_url, harness.ENCODER, autotune.apply_candidate(config, candidate))
            print(f"perf.bench.trace_report: text_encoder reloaded as {instances} instance(s) x {threads} thread(s)", flush=True)
        binary, env = pa.check()
        base = pa.Settings(
            model=MODEL,
            url=server.grpc_url,
            protocol="grpc",
            concurrency=args.concurrency,
            input_data=args.input_data,
            request_count=args.requests,
            stability_percent=100,
            max_trials=2,
            timeout_s=args.timeout,
        )
        settings = (
            base
            if not args.rate
            else harness.RateSettings(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, request_rate=args.rate)
        )
        what = f"Poisson {args.rate:g}/s" if args.rate else f"concurrency {args.concurrency}"
        print(f"perf.bench.trace_report: {MODEL} ({served.variant} encoder), {what}, every request traced", flush=True)
        try:
            m = pa.measure(settings, workdir / "run.csv", binary=binary, env=env)
            print(f"perf_analyzer: {m.throughput:.1f} infer/s, p50 {m.p50_ms:.1f} ms, p99 {m.p99_ms:.1f} ms", flush=True)
        except pa.PerfAnalyzerUnstable as exc:  # the trace is what counts here
            print(f"perf_analyzer: {exc}", flush=True)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _layout(text: str) -> tuple[int, int]:
    try:
        n, t = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected <instances>x<threads>, e.g. 2x1, got {text!r}") from None
    if n < 1 or t < 1:
        raise argparse.ArgumentTypeError(f"instances and threads must be at least 1, got {text!r}")
    return n, t


def main(argv: Iterable[str] | None = None) -> int:
    from perf.lib import served as served_mod

    p = options.parser("perf.bench.trace_report", __doc__)
    p.add_argument("--trace-file", type=Path, help="analyse this Triton trace file instead of running one")
    p.add_argument("--concurrency", type=int, default=22, help="perf_analyzer concurrency (default 22)")
    p.add_argument("--rate", type=float, help="Poisson request rate instead of a concurrency")
    p.add_argument("--requests", type=int, default=3000, help="requests per perf_analyzer window (default 3000)")
    p.add_argument("--precision", default="cpu", help="as `make serve PRECISION=` (default cpu)")
    layout_help = "reload text_encoder as N instances x T intra-op threads first (default: as configured)"
    p.add_argument("--encoder-layout", type=_layout, metavar="NxT", help=layout_help)
    p.add_argument("--input-data", type=Path, default=served_mod.DEFAULT_INPUT)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the perf_analyzer run")
    out_help = "also write the report here (default with a run: perf/results/trace-<UTC time>/report.md, beside trace.json)"
    p.add_argument("--out", type=Path, help=out_help)
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.concurrency < 1 or args.requests < 1 or (args.rate is not None and args.rate <= 0):
        p.error("--concurrency, --requests and --rate must be positive")
    trace = args.trace_file
    if trace is None:
        out_dir = report.results_dir(None, "trace")
        trace, args.out = out_dir / "trace.json", args.out or out_dir / "report.md"
        _run_traced(args, trace)
    if not trace.is_file():
        print(f"perf.bench.trace_report: no trace file at {trace}", file=sys.stderr)
        return 1
    text = markdown(analyse(load(trace)))
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
