"""`python -m perf.bench.autotune`: search the encoder's batching settings under a latency budget.

The Triton form of the seed articles' adaptive batch window: instead of a batcher that moves
its own window at run time, measure. One tritonserver serves ``text_embedding``; for each
candidate ``max_queue_delay_microseconds`` x ``preferred_batch_size`` x instance count, the
encoder is reloaded with that config through the repository API (Triton swaps the model in
about a second, no restart, the ensemble keeps its other steps) and perf_analyzer measures
the ensemble at ``--concurrency``. Each instance gets ``cores / instances`` ONNX Runtime
intra-op threads, so every candidate uses the same cores.

- A candidate is *feasible* when its P99 is within ``--latency-budget-ms``.
- The machine is noisy (shared 2-core VMs), so the best ``--finalists`` of the first pass are
  measured again, interleaved, and ranked on the median of their runs.
- The winner: the feasible finalist with the highest median throughput (none feasible: the
  lowest P99). Then one Poisson run at ``--rate-fraction`` of its throughput gives its P99 / P50.
- ``--time-budget`` bounds the run; candidates that no longer fit are listed as not tried.

Writes under ``perf/results/autotune-<UTC time>/``: ``search.csv`` (every measurement),
``summary.md``, ``text_encoder.pbtxt`` (the served config with the winning values, ready to
use as ``model_repository/text_encoder/configs/<name>.pbtxt`` or to copy values from) and
``override.json`` (the body of ``POST /v2/repository/models/text_encoder/load``, which applies
it to a running server without a restart; ``--apply HOST:PORT`` does that at the end).
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import datetime as dt
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ops.repository import RepositoryClient
from perf.lib import harness
from perf.lib import perf_analyzer as pa
from perf.lib import served as served_mod
from perf.lib.report import load_average
from perf.lib.stats import measured

MODEL = harness.MODEL
ENCODER = harness.ENCODER
DEFAULT_DELAYS_US = (0, 1000, 2000, 5000, 10000)
DEFAULT_PREFERRED = (0, 16, 32)  # 0 = none: Triton sends whatever is queued, up to max_batch_size
DEFAULT_INSTANCES = (1, 2)


@dataclass(frozen=True)
class Candidate:
    delay_us: int
    preferred: int  # 0 = no preferred_batch_size
    instances: int
    threads: int  # intra-op threads per instance

    @property
    def name(self) -> str:
        pref = f"pref{self.preferred}" if self.preferred else "nopref"
        return f"d{self.delay_us}-{pref}-i{self.instances}x{self.threads}t"

    def describe(self) -> str:
        pref = f"preferred {self.preferred}" if self.preferred else "no preferred size"
        return f"max_queue_delay {self.delay_us} us, {pref}, {self.instances} instance(s) x {self.threads} thread(s)"


@dataclass
class Trial:
    candidate: Candidate
    round: int
    throughput: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    encoder_batch: float | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.throughput is not None and self.throughput > 0


@dataclass
class Score:
    candidate: Candidate
    trials: list[Trial] = field(default_factory=list)

    def _median(self, attr: str) -> float | None:
        values = [getattr(t, attr) for t in self.trials if t.ok and getattr(t, attr) is not None]
        return statistics.median(values) if values else None

    @property
    def throughput(self) -> float | None:
        return self._median("throughput")

    @property
    def p50_ms(self) -> float | None:
        return self._median("p50_ms")

    @property
    def p99_ms(self) -> float | None:
        return self._median("p99_ms")

    @property
    def encoder_batch(self) -> float | None:
        return self._median("encoder_batch")

    def feasible(self, budget_ms: float) -> bool:
        return self.p99_ms is not None and self.p99_ms <= budget_ms


def candidates(
    delays: Sequence[int], preferred: Sequence[int], instances: Sequence[int], cores: int, max_batch: int
) -> list[Candidate]:
    """The grid, instance counts interleaved so a cut-short run has tried each of them."""
    out = []
    for delay, pref in itertools.product(delays, preferred):
        if pref > max_batch:
            continue
        for n in instances:
            out.append(Candidate(delay, pref, n, max(1, cores // n)))
    return out


def pick(scores: Sequence[Score], budget_ms: float) -> Score | None:
    """The feasible score with the highest throughput; with none feasible, the lowest P99."""
    with_throughput = [s for s in scores if s.throughput is not None]
    feasible = [s for s in with_throughput if s.feasible(budget_ms)]
    if feasible:
        return max(feasible, key=lambda s: measured(s.throughput))
    return min(with_throughput, key=lambda s: measured(s.p99_ms), default=None)


def apply_candidate(base: dict, c: Candidate) -> dict:
    """``base`` (a served config as Triton's JSON) with the candidate's batching and instances."""
    config = copy.deepcopy(base)
    batching = config.setdefault("dynamic_batching", {})
    batching["max_queue_delay_microseconds"] = str(c.delay_us)
    if c.preferred:
        batching["preferred_batch_size"] = [c.preferred]
    else:
        batching.pop("preferred_batch_size", None)
    groups = config.get("instance_group") or [{}]
    group = dict(groups[0])
    group["count"] = c.instances
    group.pop("name", None)  # Triton names groups itself; a stale name would describe the old count
    config["instance_group"] = [group]
    params = config.setdefault("parameters", {})
    params["intra_op_thread_count"] = {"string_value": str(c.threads)}
    return config


def to_pbtxt(config: dict, header: str = "") -> str:
    """A Triton JSON config as config.pbtxt text (the protobuf text format Triton reads)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    message = model_config_pb2.ModelConfig()
    json_format.ParseDict(config, message, ignore_unknown_fields=True)
    return header + text_format.MessageToString(message)


def load_config(http_url: str, model: str, config: dict, ensemble: str = MODEL, timeout: float = 120.0) -> None:
    """Load ``model`` with ``config`` through the repository API and wait until ``ensemble`` is ready."""
    harness.reload_with(http_url, model, config, ensemble, timeout)


def served_config(http_url: str, model: str = ENCODER) -> dict:
    return RepositoryClient(http_url).config(model)


# --------------------------------------------------------------------------- arguments


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.autotune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a 2 x 1 x 2 grid with tiny windows (CI smoke)")
    p.add_argument("--precision", default="cpu", help="what Triton serves, as `make serve PRECISION=` (default cpu)")
    p.add_argument("--concurrency", type=int, default=32, help="perf_analyzer concurrency (default 32)")
    p.add_argument(
        "--latency-budget-ms",
        type=float,
        default=120.0,
        help="P99 a candidate must stay within at --concurrency (default 120 ms)",
    )
    p.add_argument("--delays", type=_int_list, help="max_queue_delay_microseconds values (default 0,1000,2000,5000,10000)")
    p.add_argument("--preferred", type=_int_list, help="preferred_batch_size values, 0 = none (default 0,16,32)")
    p.add_argument("--instances", type=_int_list, help="encoder instance counts (default 1,2)")
    p.add_argument("--finalists", type=int, default=3, help="best candidates measured again (default 3)")
    p.add_argument("--final-rounds", type=int, default=2, help="extra interleaved rounds of the finalists (default 2)")
    p.add_argument(
        "--rate-fraction",
        type=float,
        default=0.7,
        help="Poisson rate for the winner's P99 / P50, as a fraction of its throughput (0 = skip)",
    )
    p.add_argument("--time-budget", type=float, help="seconds for the whole run (default 900, --quick 120)")
    p.add_argument("--request-count", type=int, help="requests per window (default 600, --quick 60)")
    p.add_argument("--stability-percent", type=float, help="perf_analyzer -s (default 30, --quick 100)")
    p.add_argument("--max-trials", type=int, help="windows before a measurement is unstable (default 5, --quick 3)")
    p.add_argument("--input-data", type=Path, default=served_mod.DEFAULT_INPUT, help="perf_analyzer input JSON")
    p.add_argument(
        "--apply",
        metavar="HOST:PORT",
        help="load the winning config into this running server's HTTP endpoint (e.g. 127.0.0.1:8000)",
    )
    p.add_argument("--out-dir", type=Path, help="results folder (default perf/results/autotune-<UTC time>)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    q = args.quick
    defaults = dict(
        time_budget=120.0 if q else 900.0,
        request_count=60 if q else 600,
        stability_percent=100.0 if q else 30.0,
        max_trials=3 if q else 5,
        delays=[0, 2000] if q else list(DEFAULT_DELAYS_US),
        preferred=[0] if q else list(DEFAULT_PREFERRED),
        instances=[1, 2] if q else list(DEFAULT_INSTANCES),
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if q:
        args.finalists, args.final_rounds = min(args.finalists, 2), min(args.final_rounds, 1)
    if min(args.concurrency, args.request_count, args.max_trials) < 1 or args.time_budget <= 0:
        p.error("--concurrency, --request-count, --max-trials and --time-budget must be positive")
    if min(args.instances) < 1:
        p.error("--instances must be at least 1")
    if args.latency_budget_ms <= 0:
        p.error("--latency-budget-ms must be positive")
    if args.finalists < 1 or args.final_rounds < 0:
        p.error("--finalists must be >= 1 and --final-rounds >= 0")
    if not 0 <= args.rate_fraction < 1:
        p.error("--rate-fraction must be in [0, 1)")
    if not args.input_data.is_file():
        p.error(f"input data {args.input_data} not found")
    return args


# --------------------------------------------------------------------------- the search


def measure(run: harness.Run, server, c: Candidate, round_: int, steps_after: int) -> Trial:
    a = run.args
    trial = Trial(c, round_)
    row = harness.Row(f"r{round_}-{c.name}", f"{ENCODER} {c.describe()}", "grpc", f"concurrency {a.concurrency}")
    settings = harness.settings_for(run, server.grpc_url, "grpc", a.concurrency)
    harness.measure_served(run, row, settings, steps_after, server.http_url)
    trial.error = row.error
    if row.ok:
        trial.throughput, trial.p50_ms, trial.p99_ms = row.throughput, row.p50_ms, row.p99_ms
        stats = row.measurement.composing.get(ENCODER) if row.measurement else None
        trial.encoder_batch = stats.avg_batch if stats else None
    return trial


def write_csv(path: Path, trials: Sequence[Trial]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "round",
                "candidate",
                "max_queue_delay_us",
                "preferred_batch_size",
                "instances",
                "threads",
                "throughput",
                "p50_ms",
                "p99_ms",
                "encoder_mean_batch",
                "error",
            ]
        )
        for t in trials:
            c = t.candidate
            w.writerow(
                [
                    t.round,
                    c.name,
                    c.delay_us,
                    c.preferred or "",
                    c.instances,
                    c.threads,
                    "" if t.throughput is None else f"{t.throughput:.1f}",
                    "" if t.p50_ms is None else f"{t.p50_ms:.2f}",
                    "" if t.p99_ms is None else f"{t.p99_ms:.2f}",
                    "" if t.encoder_batch is None else f"{t.encoder_batch:.2f}",
                    t.error,
                ]
            )


def _fmt(v: float | None, digits: int = 1) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def summary_markdown(
    header: Sequence[str],
    scores: Sequence[Score],
    winner: Score | None,
    budget_ms: float,
    untried: Sequence[Candidate],
    rate_row: harness.Row | None,
) -> str:
    lines = list(header) + [
        "",
        "| candidate | runs | throughput (infer/s, median) | p50 (ms) | p99 (ms) | encoder mean batch | within budget |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    ranked = sorted(scores, key=lambda s: -(s.throughput or 0))
    for s in ranked:
        runs = sum(t.ok for t in s.trials)
        mark = " **(winner)**" if winner is not None and s is winner else ""
        errors = "; ".join(sorted({t.error for t in s.trials if t.error}))
        within = ("yes" if s.feasible(budget_ms) else "no") if s.p99_ms is not None else errors or "not measured"
        lines.append(
            f"| {s.candidate.describe()}{mark} | {runs} | {_fmt(s.throughput)} | {_fmt(s.p50_ms)} | "
            f"{_fmt(s.p99_ms)} | {_fmt(s.encoder_batch, 2)} | {within} |"
        )
    if untried:
        lines += ["", f"Not tried (time budget): {', '.join(c.describe() for c in untried)}."]
    if winner is not None:
        lines += [
            "",
            f"Winner: {winner.candidate.describe()}: {_fmt(winner.throughput)} infer/s, "
            f"p50 {_fmt(winner.p50_ms)} ms, p99 {_fmt(winner.p99_ms)} ms "
            f"({'within' if winner.feasible(budget_ms) else 'NOT within'} the {budget_ms:g} ms budget).",
        ]
    if rate_row is not None:
        if rate_row.ok and rate_row.p50_ms:
            lines.append(
                f"Winner under Poisson arrivals, {rate_row.load}: {_fmt(rate_row.throughput)} infer/s, "
                f"p50 {_fmt(rate_row.p50_ms)} ms, p99 {_fmt(rate_row.p99_ms)} ms, "
                f"P99 / P50 = {measured(rate_row.p99_ms) / rate_row.p50_ms:.2f}."
            )
        else:
            lines.append(f"Winner under Poisson arrivals ({rate_row.load}): {rate_row.error or 'not measured'}.")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from perf.lib.deployment import server_deployment
    from server.process import ServerError

    state = harness.new_run(args, "autotune")
    if state is None:
        return 2
    out_dir = state.out_dir
    served = served_mod.served_encoder(args.precision)
    args.no_export = False
    if not harness.ensure_exported(served, args, state.say):
        return 1
    served = served_mod.served_encoder(args.precision)
    cores = os.cpu_count() or 1
    load = load_average()

    workdir = Path(tempfile.mkdtemp(prefix="perf-autotune-"))
    server = server_deployment((MODEL,), workdir, model_config_name=served.config_name)
    state.say(
        f"perf.bench.autotune: {ENCODER} {served.variant}, concurrency {args.concurrency}, P99 budget "
        f"{args.latency_budget_ms:g} ms, time budget {args.time_budget:.0f} s, {cores} cores, load average {load}"
    )
    server.start()
    trials: list[Trial] = []
    scores: dict[Candidate, Score] = {}
    untried: list[Candidate] = []
    winner: Score | None = None
    rate_row: harness.Row | None = None
    base: dict = {}
    try:
        try:
            server.wait_ready(timeout=max(min(240.0, state.left()), 1.0))
        except ServerError as exc:
            state.say(f"    {exc}\n{exc.log_tail}")
            return 1
        base = served_config(server.http_url)
        grid = candidates(args.delays, args.preferred, args.instances, cores, int(base.get("max_batch_size", 0)))
        state.say(f"first pass: {len(grid)} candidates")

        def try_one(c: Candidate, round_: int, remaining: int) -> bool:
            if state.left() < 20:
                return False
            state.say(f"[round {round_}] {c.describe()}")
            try:
                load_config(server.http_url, ENCODER, apply_candidate(base, c), timeout=min(120.0, state.left()))
            except (RuntimeError, OSError) as exc:
                state.say(f"    reload failed: {exc}")
                t = Trial(c, round_, error=f"reload failed: {exc}")
            else:
                t = measure(state, server, c, round_, steps_after=remaining)
            trials.append(t)
            scores.setdefault(c, Score(c)).trials.append(t)
            write_csv(out_dir / "search.csv", trials)
            return True

        for i, c in enumerate(grid):
            if not try_one(c, 1, 0):
                untried = grid[i:]
                break
        first = [s for s in scores.values() if s.throughput is not None]
        feasible = sorted((s for s in first if s.feasible(args.latency_budget_ms)), key=lambda s: -measured(s.throughput))
        others = sorted((s for s in first if not s.feasible(args.latency_budget_ms)), key=lambda s: measured(s.p99_ms))
        finalists = (feasible + others)[: args.finalists]
        for r in range(2, 2 + args.final_rounds):
            for s in finalists:
                try_one(s.candidate, r, 0)
        winner = pick(finalists or list(scores.values()), args.latency_budget_ms)
        if winner is not None:
            load_config(server.http_url, ENCODER, apply_candidate(base, winner.candidate))
            if args.rate_fraction > 0 and winner.throughput and state.left() > 20:
                rate = args.rate_fraction * winner.throughput
                rate_row = harness.Row(
                    "winner-rate", "winner", "grpc", f"{rate:.0f}/s ({args.rate_fraction:.0%} of {winner.throughput:.0f})"
                )
                state.say(f"winner under Poisson arrivals at {rate_row.load}")
                b = pa.Settings(
                    model=MODEL,
                    url=server.grpc_url,
                    protocol="grpc",
                    concurrency=1,
                    input_data=args.input_data,
                    request_count=args.request_count,
                    stability_percent=max(args.stability_percent, 50.0),
                    max_trials=args.max_trials,
                )
                settings = harness.RateSettings(**{f.name: getattr(b, f.name) for f in dataclasses.fields(b)}, request_rate=rate)
                harness.measure(state, rate_row, settings, 0)
    finally:
        server.stop(logs_to=out_dir)
        shutil.rmtree(workdir, ignore_errors=True)

    header = [
        f"# Autotune: {ENCODER} ({served.variant}) batching in {MODEL}",
        "",
        f"- {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {cores} CPUs, load average at the start {load}",
        f"- command: `{' '.join(['python -m perf.bench.autotune', *args.argv])}`",
        f"- perf_analyzer gRPC, concurrency {args.concurrency}, windows of {args.request_count} requests, "
        f"-s {args.stability_percent:g}; P99 budget {args.latency_budget_ms:g} ms; the best {args.finalists} "
        f"of the first pass measured {args.final_rounds} more time(s), interleaved; medians below",
    ]
    table = summary_markdown(header, list(scores.values()), winner, args.latency_budget_ms, untried, rate_row)
    (out_dir / "summary.md").write_text(table)
    write_csv(out_dir / "search.csv", trials)
    print("\n" + table, flush=True)
    if winner is None:
        state.say("perf.bench.autotune: no candidate was measured")
        return 1
    config = apply_candidate(base, winner.candidate)
    note = (
        f"# Written by `python -m perf.bench.autotune` {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: "
        f"{winner.candidate.describe()};\n# {_fmt(winner.throughput)} infer/s, p50 {_fmt(winner.p50_ms)} ms, "
        f"p99 {_fmt(winner.p99_ms)} ms at concurrency {args.concurrency} (summary.md beside this file).\n"
    )
    (out_dir / f"{ENCODER}.pbtxt").write_text(to_pbtxt(config, note))
    (out_dir / "override.json").write_text(json.dumps({"parameters": {"config": json.dumps(config)}}, indent=1) + "\n")
    if args.apply:
        load_config(args.apply, ENCODER, config)
        state.say(f"perf.bench.autotune: winning config loaded into {args.apply}")
    state.say(f"perf.bench.autotune: results in {pa.display_path(out_dir)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
