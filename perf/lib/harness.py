"""The perf_analyzer sweep engine: perf.bench.sweep, compare, autotune and baseline are scenarios of it.

A run (its options, deadline, perf_analyzer and results folder), the target (a tritonserver it starts
or a URL it is given), one point (a concurrency or a Poisson rate; retried once with twice the
requests when it does not stabilise; every model's share from Triton's statistics), model config
reloads through the repository API (ops.repository.RepositoryClient, which sends the repository
token), and the report: the rows as CSV and as markdown tables, the per-step breakdown.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ops.repository import RepositoryClient
from perf.lib import options, report, triton_stats
from perf.lib import perf_analyzer as pa
from perf.lib.paths import SENTENCES_16TOK
from perf.lib.report import fmt, write_csv  # noqa: F401 - the scenarios' CSV writer

MODEL = "text_embedding"
ENCODER = "text_encoder"


@dataclass(frozen=True)
class RateSettings(pa.Settings):
    """perf_analyzer at a fixed request rate (Poisson arrivals) instead of a fixed concurrency."""

    request_rate: float = 1.0
    distribution: str = "poisson"

    def command(self, binary: Path, csv_path: Path) -> list[str]:
        cmd = super().command(binary, csv_path)
        i = cmd.index("--concurrency-range")
        # --async: open-loop arrivals; with synchronous calls a few client threads cannot
        # keep a Poisson schedule once latency grows (perf_analyzer then delays requests).
        rate = ["--request-rate-range", f"{self.request_rate:.0f}", "--request-distribution", self.distribution, "--async"]
        cmd[i : i + 2] = rate
        return cmd


def at_rate(settings: pa.Settings, rate: float) -> RateSettings:
    return RateSettings(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}, request_rate=rate)


@dataclass
class Row:
    """One system under one load: a measurement, or the reason there is none; ``tags``: the scenario's own columns."""

    key: str  # short id, used for file names and ratios
    system: str
    protocol: str  # in-process, http, grpc
    load: str
    throughput: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    measurement: pa.Measurement | None = None
    error: str = ""
    note: str = ""
    wall_s: float = 0.0
    kind: str = "concurrency"  # or "rate" (Poisson arrivals), set by point()
    level: float = 0.0  # the concurrency, or the asked request rate (req/s)
    tags: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.throughput is not None and self.throughput > 0

    def record(self) -> dict[str, object]:
        """The row as one CSV record: its fields, its tags, then every figure of its measurement."""
        names = ("key", "system", "protocol", "load", "kind", "level", "throughput", "p50_ms", "p99_ms", "error", "note")
        record: dict[str, object] = {**{n: getattr(self, n) for n in names}, "wall_s": round(self.wall_s, 1), **self.tags}
        if self.measurement is not None:
            record.update({k: v for k, v in self.measurement.as_row().items() if k not in record})
        return record


@dataclass
class Run:
    args: argparse.Namespace
    out_dir: Path
    deadline: float
    binary: Path
    env: dict
    rows: list[Row] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, message: str) -> None:
        report.progress(self.started)(message)


def measure(run: Run, row: Row, settings: pa.Settings, steps_after: int, stats_url: str | None = None) -> Row:
    """One perf_analyzer measurement into ``row``, retried once (twice the requests) if unstable.

    With ``stats_url`` (the server's HTTP endpoint) the measured model's and every other model's figures
    (BLS-called ones too) come from the server's statistics over the whole perf_analyzer run.
    """
    started = time.monotonic()
    before = None
    with contextlib.suppress(OSError):
        before = triton_stats.snapshot(stats_url) if stats_url else None
    for attempt in (1, 2):
        # Leave each later measurement at least 10 s of the budget.
        timeout = min(run.left() - 10.0 * steps_after, 300.0)
        if timeout < 5:
            row.error = row.error or "time budget used up"
            break
        settings = dataclasses.replace(settings, timeout_s=timeout)
        stem = row.key if attempt == 1 else f"{row.key}-retry"
        try:
            log_path = run.out_dir / f"{stem}.log"
            m = pa.measure(settings, run.out_dir / f"{stem}.csv", log_path=log_path, binary=run.binary, env=run.env)
        except pa.PerfAnalyzerUnstable as exc:
            row.error = "unstable"
            run.say(f"    {exc}")
            if attempt == 1:
                settings = dataclasses.replace(settings, request_count=settings.request_count * 2)
                run.say(f"    retrying with {settings.request_count} requests per window")
            continue
        except pa.PerfAnalyzerTimeout as exc:
            row.error = "timed out"
            run.say(f"    {exc}")
            break
        except pa.PerfAnalyzerError as exc:
            row.error = str(exc).splitlines()[0]
            run.say(f"    {exc}\n{exc.output_tail(15)}")
            break
        if before is not None and (served := triton_stats.fetch_delta(str(stats_url), before)):
            m = dataclasses.replace(m, server=served.pop(settings.model, None), composing=served)
        row.measurement, row.error = m, ""
        row.throughput, row.p50_ms, row.p99_ms = m.throughput, m.p50_ms, m.p99_ms
        if isinstance(settings, RateSettings):
            row.note = f"achieved {m.throughput / settings.request_rate:.0%} of the asked rate"
            row.note += "".join(f"; {w}" for w in rate_warnings(log_path.read_text(errors="replace")))
        break
    row.wall_s = time.monotonic() - started
    if row.ok:
        run.say(f"    {row.throughput:.1f} infer/s, p50 {row.p50_ms:.1f} ms, p99 {row.p99_ms:.1f} ms ({row.wall_s:.0f} s)")
    return row


def point(
    run: Run,
    row: Row,
    url: str,
    *,
    concurrency: int = 1,
    rate: float | None = None,
    steps_after: int = 0,
    stats_url: str | None = None,
    **settings: Any,
) -> Row:
    """``row`` measured at ``concurrency`` (or at a Poisson ``rate``) with the run's perf_analyzer options;
    ``settings``: pa.Settings fields that differ from the run's (model, input_data, request_count, ...)."""
    a = run.args
    row.kind, row.level = ("concurrency", float(concurrency)) if rate is None else ("rate", rate)
    options = dict(model=MODEL, input_data=a.input_data, request_count=a.request_count, stability_percent=a.stability_percent)
    base = pa.Settings(
        **{**options, **settings}, url=url, protocol=row.protocol, concurrency=concurrency, max_trials=a.max_trials
    )
    measure(run, row, base if rate is None else at_rate(base, rate), steps_after, stats_url)
    stats = row.measurement.composing.get(ENCODER) if row.measurement else None
    if stats is not None and stats.avg_batch is not None:
        b = stats.breakdown_ms
        note = f"{ENCODER} mean batch {stats.avg_batch:.2f}, queue {b.get('queue', 0):.1f} ms, infer {b.get('compute infer', 0):.1f} ms"
        row.note = f"{row.note}; {note}" if row.note else note
    return row


def rate_warnings(output: str) -> list[str]:
    """perf_analyzer's warnings that make a request-rate measurement doubtful, in short."""
    warnings = []
    if m := re.search(r"(\d+(?:\.\d+)?)% of the requests were delayed", output):
        if float(m.group(1)) > 5.0:  # a few late sends are harmless; many mean a closed loop in disguise
            warnings.append(f"perf_analyzer sent {m.group(1)} % of the requests late")
    if "Request latency is not stabilizing" in output:
        warnings.append("perf_analyzer: latency did not stabilise")
    return warnings


@contextlib.contextmanager
def triton(run: Run, models: Sequence[str], config_name: str | None, timeout: float = 240.0) -> Iterator:
    """tritonserver serving ``models`` (--model-config-name ``config_name``) on free ports, ready; stopped
    after with its log in the results folder. Raises server.process.ServerError when it does not start."""
    from perf.lib.deployment import server_deployment

    workdir = Path(tempfile.mkdtemp(prefix="perf-"))
    server = server_deployment(tuple(models), workdir, model_config_name=config_name)
    run.say(f"tritonserver: starting ({', '.join(models)}; --model-config-name={config_name or '(none: FP32)'})")
    server.start()
    try:
        server.wait_ready(timeout=max(min(timeout, run.left()), 1.0))
        run.say(f"tritonserver: ready ({run.left():.0f} s of budget left)")
        yield server
    finally:
        server.stop(logs_to=run.out_dir)
        shutil.rmtree(workdir, ignore_errors=True)
        run.say("tritonserver: stopped")


def ensure_exported(args: argparse.Namespace, say: Callable[[str], None], names: Sequence[str], files: Sequence[Path]) -> bool:
    """Export the models ``names`` when one of ``files`` is missing (never with --no-export)."""
    if all(f.is_file() for f in files):
        return True
    if args.no_export:
        say(f"model files missing ({', '.join(str(f) for f in files if not f.is_file())}) and --no-export given")
        return False
    from export import __main__ as export_main

    say(f"exporting {', '.join(names)} (model files missing)")
    export_main.main([a for n in names for a in ("--model", n)] + ["--no-speed"])
    return all(f.is_file() for f in files)


def reload_with(http_url: str, model: str, config: dict, ensemble: str = MODEL, timeout: float = 120.0) -> None:
    """Load ``model`` with ``config`` (a config override) and wait until ``ensemble`` is ready."""
    client = RepositoryClient(http_url, timeout=timeout)
    client.load(model, config)
    client.wait_ready(ensemble, timeout=timeout)


def disable_all_dynamic_batching(http_url: str, ensemble: str = MODEL, timeout: float = 120.0) -> list[str]:
    """Reload every loaded model that batches (but ``ensemble``) with its served config minus dynamic_batching.

    Every step, not only the encoder: a Python step in front of it (the canary router) would otherwise
    still merge requests into one encoder call. Returns the models switched; RuntimeError when Triton
    refuses, a reloaded config still batches or no model batches.
    """
    client = RepositoryClient(http_url, timeout=timeout)
    index = json.loads(client.post("/v2/repository/index", b'{"ready": true}'))
    switched = []
    for name in sorted({m["name"] for m in index if m.get("state", "READY") == "READY"} - {ensemble}):
        before = client.config(name)
        if "dynamic_batching" in before:
            client.load(name, {k: v for k, v in before.items() if k != "dynamic_batching"})
            if "dynamic_batching" in client.config(name):
                raise RuntimeError(f"{name} still has dynamic_batching after the reload")
            client.wait_ready(ensemble, timeout=timeout)
            switched.append(name)
    if not switched:
        raise RuntimeError("no loaded model has dynamic batching to switch off")
    return switched


# Per option: (default, --quick default), filled in by parse() where a tool does not set its own.
DEFAULTS = {"time_budget": (900.0, 120.0), "request_count": (500, 60), "stability_percent": (30.0, 100.0), "max_trials": (6, 3)}


def parser(tool: str, doc: str | None, quick: str, **defaults: tuple[object, object]) -> argparse.ArgumentParser:
    """The options every perf_analyzer scenario has; ``defaults``: name -> (default, --quick default)."""
    d = {**DEFAULTS, **defaults}
    p = options.parser(f"perf.bench.{tool}", doc)
    p.set_defaults(scenario_defaults=d)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument(
        "--precision", default="cpu", help="what Triton serves, as `make serve PRECISION=`: cpu (default), fp32, auto, ..."
    )

    def both(name: str) -> str:
        return f"default {d[name][0]:g}, --quick {d[name][1]:g}"

    p.add_argument("--time-budget", type=float, help=f"seconds for the whole run, server start included ({both('time_budget')})")
    p.add_argument("--request-count", type=int, help=f"requests per measurement window ({both('request_count')})")
    p.add_argument("--stability-percent", type=float, help=f"perf_analyzer -s ({both('stability_percent')})")
    p.add_argument("--max-trials", type=int, help=f"windows before a measurement is unstable ({both('max_trials')})")
    p.add_argument("--input-data", type=Path, help="perf_analyzer input JSON (default perf/data/sentences_16tok.json)")
    p.add_argument("--out-dir", type=Path, help=f"results folder (default perf/results/{tool}-<UTC time>)")
    p.add_argument("--no-export", action="store_true", help="never export, even when model files are missing")
    p.add_argument("--verbose", action="store_true", help="log perf_analyzer command lines")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parsed options with the (--quick) defaults filled in and checked; ``argv`` kept for the report."""
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.input_given, args.input_data = args.input_data is not None, args.input_data or SENTENCES_16TOK
    for name, (full, quick) in args.scenario_defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if min(args.request_count, args.max_trials) < 1 or args.time_budget <= 0:
        p.error("--request-count, --max-trials and --time-budget must be positive")
    if args.input_data is not None and not args.input_data.is_file():
        p.error(f"input data {args.input_data} not found")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S"
    )
    return args


RunT = TypeVar("RunT", bound=Run)


def new_run(args: argparse.Namespace, kind: str, run_class: type[RunT] = Run) -> RunT | None:  # type: ignore[assignment]
    """A run of ``perf.bench.<kind>``: its deadline, perf_analyzer, and its results folder (``--out-dir``
    or perf/results/<kind>-<UTC time>). None (said why) without perf_analyzer."""
    deadline = time.monotonic() + args.time_budget
    try:
        binary, env = pa.check()
    except pa.PerfAnalyzerNotAvailable as exc:
        print(f"perf.bench.{kind}: {exc}", flush=True)
        return None
    return run_class(args, report.results_dir(args.out_dir, kind), deadline, binary, env)


def header(title: str, args: argparse.Namespace, tool: str, load: str, *lines: str) -> list[str]:
    """perf.lib.report's header of a scenario's summary, then its own ``lines`` as bullets."""
    return report.header(title, f"perf.bench.{tool}", args.argv, load) + [f"- {line}" for line in lines]


def table(rows: Sequence[Row]) -> list[str]:
    head = ["system", "protocol", "load", "throughput (infer/s)", "p50 (ms)", "p99 (ms)", "p99/p50", "notes"]
    cells = [
        [r.system, r.protocol, r.load, fmt(r.throughput) if r.ok else f"failed: {r.error}", fmt(r.p50_ms), fmt(r.p99_ms)]
        + [fmt(r.p99_ms / r.p50_ms, 2) if r.p99_ms and r.p50_ms else "", r.note]
        for r in rows
    ]
    return report.table(head, cells, left=3).splitlines()


def breakdown(rows: Sequence[Row]) -> list[str]:
    """Where the time goes on the server, per measurement and step (mean ms per request, mean batch)."""
    measured = [(r, r.measurement) for r in rows if r.measurement is not None and r.measurement.composing]
    if not measured:
        return []
    lines = [
        "",
        "Server side, per step (mean ms per request; Triton's statistics over the whole perf_analyzer run where the "
        "tool read them, BLS calls included; a step's compute is the whole execution its request was part of):",
        "",
    ]
    steps = [
        (r.key if i == 0 else "", name, m.composing[name])
        for r, m in measured
        for i, name in enumerate(sorted(m.composing, key=lambda n: (n != "text_tokenizer", n)))
    ]
    head = ["measurement", "step", "queue", "compute input", "compute infer", "compute output", "mean batch"]
    figures = [("queue", 1), ("compute input", 2), ("compute infer", 1), ("compute output", 2)]
    cells = [[key, name, *(fmt(s.breakdown_ms.get(f), d) for f, d in figures), fmt(s.avg_batch, 2)] for key, name, s in steps]
    return lines + report.table(head, cells, left=2).splitlines()


def finish(run: Run, tool: str, lines: Sequence[str], csv_name: str, records: Sequence[Mapping[str, object]]) -> None:
    """summary.md and the CSV of the records in the results folder; the summary printed."""
    report.write(run.out_dir, "\n".join(lines) + "\n", csvs={csv_name: records}, say=run.say)
