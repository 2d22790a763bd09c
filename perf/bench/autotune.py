"""`python -m perf.bench.autotune`: search the encoder's batching settings under a latency budget.

A sweep scenario (perf.lib.harness) over configs: one tritonserver serves ``text_embedding``; each
``max_queue_delay_microseconds`` x ``preferred_batch_size`` x instance count (each instance with
``cores / instances`` intra-op threads) is loaded into the encoder through the repository API (no
restart) and measured at ``--concurrency``. The best ``--finalists`` are measured again, interleaved;
the winner is the one with the highest median throughput whose P99 is within ``--latency-budget-ms``
(none: the lowest P99), then measured under Poisson arrivals at ``--rate-fraction`` of it.

Writes under ``perf/results/autotune-<UTC time>/``: ``search.csv``, ``summary.md``, ``text_encoder.pbtxt``
(the served config with the winning values) and ``override.json`` (the body of ``POST
/v2/repository/models/text_encoder/load``; ``--apply HOST:PORT`` loads it into a running server).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import functools
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ops.repository import RepositoryClient
from perf.lib import harness, options
from perf.lib import served as served_mod
from perf.lib.harness import ENCODER, MODEL, Row
from perf.lib.report import display_path, fmt, load_average
from perf.lib.stats import measured, median

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
        return f"d{self.delay_us}-{f'pref{self.preferred}' if self.preferred else 'nopref'}-i{self.instances}x{self.threads}t"

    def describe(self) -> str:
        pref = f"preferred {self.preferred}" if self.preferred else "no preferred size"
        return f"max_queue_delay {self.delay_us} us, {pref}, {self.instances} instance(s) x {self.threads} thread(s)"


def trial(c: Candidate, round_: int, concurrency: int = 0, **figures) -> Row:
    """One measurement of a candidate: a harness row whose tags are the candidate's settings (search.csv's columns)."""
    tags = {"round": round_, "candidate": c.name, "max_queue_delay_us": c.delay_us, "preferred_batch_size": c.preferred or ""}
    tags |= {"instances": c.instances, "threads": c.threads}
    return Row(f"r{round_}-{c.name}", f"{ENCODER} {c.describe()}", "grpc", f"concurrency {concurrency}", tags=tags, **figures)


def encoder_batch(row: Row) -> float | None:
    stats = row.measurement.composing.get(ENCODER) if row.measurement else None
    return stats.avg_batch if stats else None


@dataclass
class Score:
    """A candidate's trials (harness rows); its figures are their medians."""

    candidate: Candidate
    trials: list[Row] = field(default_factory=list)

    def _median(self, figure: Callable[[Row], float | None]) -> float | None:
        return median([figure(t) for t in self.trials if t.ok])

    throughput = property(functools.partial(_median, figure=lambda t: t.throughput))
    p50_ms = property(functools.partial(_median, figure=lambda t: t.p50_ms))
    p99_ms = property(functools.partial(_median, figure=lambda t: t.p99_ms))
    encoder_batch = property(functools.partial(_median, figure=encoder_batch))

    def feasible(self, budget_ms: float) -> bool:
        return self.p99_ms is not None and self.p99_ms <= budget_ms


def candidates(
    delays: Sequence[int], preferred: Sequence[int], instances: Sequence[int], cores: int, max_batch: int
) -> list[Candidate]:
    """The grid, instance counts interleaved so a cut-short run has tried each of them."""
    grid = itertools.product(delays, [p for p in preferred if p <= max_batch], instances)
    return [Candidate(delay, pref, n, max(1, cores // n)) for delay, pref, n in grid]


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
    group = dict((config.get("instance_group") or [{}])[0], count=c.instances)
    group.pop("name", None)  # Triton names groups itself; a stale name would describe the old count
    config["instance_group"] = [group]
    config.setdefault("parameters", {})["intra_op_thread_count"] = {"string_value": str(c.threads)}
    return config


def to_pbtxt(config: dict, header: str = "") -> str:
    """A Triton JSON config as config.pbtxt text (the protobuf text format Triton reads)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    message = model_config_pb2.ModelConfig()
    json_format.ParseDict(config, message, ignore_unknown_fields=True)
    return header + text_format.MessageToString(message)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    def non_negative(text: str) -> list[int]:
        return options.int_list(text, low=0)

    p = harness.parser(
        "autotune",
        __doc__,
        "a 2 x 1 x 2 grid with tiny windows (CI smoke)",
        time_budget=(900.0, 120.0),
        request_count=(600, 60),
        max_trials=(5, 3),
        delays=(list(DEFAULT_DELAYS_US), [0, 2000]),
        preferred=(list(DEFAULT_PREFERRED), [0]),
        instances=(list(DEFAULT_INSTANCES), [1, 2]),
    )
    p.add_argument("--concurrency", type=int, default=32, help="perf_analyzer concurrency (default 32)")
    p.add_argument("--latency-budget-ms", type=float, default=120.0, help="P99 a candidate must stay within (default 120 ms)")
    p.add_argument("--delays", type=non_negative, help="max_queue_delay_microseconds values (default 0,1000,2000,5000,10000)")
    p.add_argument("--preferred", type=non_negative, help="preferred_batch_size values, 0 = none (default 0,16,32)")
    p.add_argument("--instances", type=options.int_list, help="encoder instance counts (default 1,2)")
    p.add_argument("--finalists", type=int, default=3, help="best candidates measured again (default 3)")
    p.add_argument("--final-rounds", type=int, default=2, help="extra interleaved rounds of the finalists (default 2)")
    p.add_argument(
        "--rate-fraction", type=float, default=0.7, help="Poisson rate for the winner's P99 / P50, of its throughput (0 = skip)"
    )
    p.add_argument("--apply", metavar="HOST:PORT", help="load the winning config into this running server's HTTP endpoint")
    args = harness.parse(p, argv)
    if args.quick:
        args.finalists, args.final_rounds = min(args.finalists, 2), min(args.final_rounds, 1)
    if args.concurrency < 1 or args.latency_budget_ms <= 0:
        p.error("--concurrency and --latency-budget-ms must be positive")
    if args.finalists < 1 or args.final_rounds < 0:
        p.error("--finalists must be >= 1 and --final-rounds >= 0")
    if not 0 <= args.rate_fraction < 1:
        p.error("--rate-fraction must be in [0, 1)")
    return args


def summary_markdown(
    header: Sequence[str],
    scores: Sequence[Score],
    winner: Score | None,
    budget_ms: float,
    untried: Sequence[Candidate],
    rate_row: Row | None,
) -> str:
    lines = list(header) + [
        "",
        "| candidate | runs | throughput (infer/s, median) | p50 (ms) | p99 (ms) | encoder mean batch | within budget |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for s in sorted(scores, key=lambda s: -(s.throughput or 0)):
        mark = " **(winner)**" if s is winner else ""
        errors = "; ".join(sorted({t.error for t in s.trials if t.error}))
        within = ("yes" if s.feasible(budget_ms) else "no") if s.p99_ms is not None else errors or "not measured"
        lines.append(
            f"| {s.candidate.describe()}{mark} | {sum(t.ok for t in s.trials)} | {fmt(s.throughput)} | "
            f"{fmt(s.p50_ms)} | {fmt(s.p99_ms)} | {fmt(s.encoder_batch, 2)} | {within} |"
        )
    if untried:
        lines += ["", f"Not tried (time budget): {', '.join(c.describe() for c in untried)}."]
    if winner is not None:
        within = "within" if winner.feasible(budget_ms) else "NOT within"
        lines += [
            "",
            f"Winner: {winner.candidate.describe()}: {fmt(winner.throughput)} infer/s, p50 {fmt(winner.p50_ms)} ms, "
            f"p99 {fmt(winner.p99_ms)} ms ({within} the {budget_ms:g} ms budget).",
        ]
    if rate_row is not None and rate_row.ok and rate_row.p50_ms:
        lines.append(
            f"Winner under Poisson arrivals, {rate_row.load}: {fmt(rate_row.throughput)} infer/s, p50 {fmt(rate_row.p50_ms)} ms, "
            f"p99 {fmt(rate_row.p99_ms)} ms, P99 / P50 = {measured(rate_row.p99_ms) / rate_row.p50_ms:.2f}."
        )
    elif rate_row is not None:
        lines.append(f"Winner under Poisson arrivals ({rate_row.load}): {rate_row.error or 'not measured'}.")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from server.process import ServerError

    state = harness.new_run(args, "autotune")
    if state is None:
        return 2
    served = served_mod.served_encoder(args.precision)
    tokenizer = served_mod.REPOSITORY / served_mod.TOKENIZER / "1" / "tokenizer.json"
    if not harness.ensure_exported(args, state.say, [ENCODER], [served.model_path, tokenizer]):
        return 1
    served = served_mod.served_encoder(args.precision)
    cores, load = os.cpu_count() or 1, load_average()
    state.say(
        f"perf.bench.autotune: {ENCODER} {served.variant}, concurrency {args.concurrency}, P99 budget "
        f"{args.latency_budget_ms:g} ms, time budget {args.time_budget:.0f} s, {cores} cores, load average {load}"
    )
    trials: list[Row] = []
    scores: dict[Candidate, Score] = {}
    untried: list[Candidate] = []
    winner: Score | None = None
    rate_row: Row | None = None
    base: dict = {}
    try:
        with harness.triton(state, (MODEL,), served.config_name) as server:
            base = RepositoryClient(server.http_url).config(ENCODER)
            grid = candidates(args.delays, args.preferred, args.instances, cores, int(base.get("max_batch_size", 0)))
            state.say(f"first pass: {len(grid)} candidates")

            def try_one(c: Candidate, round_: int) -> bool:
                if state.left() < 20:
                    return False
                state.say(f"[round {round_}] {c.describe()}")
                t = trial(c, round_, args.concurrency)
                try:
                    harness.reload_with(server.http_url, ENCODER, apply_candidate(base, c), timeout=min(120.0, state.left()))
                except (RuntimeError, OSError) as exc:
                    state.say(f"    reload failed: {exc}")
                    t.error = f"reload failed: {exc}"
                else:
                    harness.point(state, t, server.grpc_url, concurrency=args.concurrency, stats_url=server.http_url)
                trials.append(t)
                scores.setdefault(c, Score(c)).trials.append(t)
                harness.write_csv(state.out_dir / "search.csv", [t.record() for t in trials])
                return True

            for i, c in enumerate(grid):
                if not try_one(c, 1):
                    untried = grid[i:]
                    break
            first = [s for s in scores.values() if s.throughput is not None]
            feasible = sorted((s for s in first if s.feasible(args.latency_budget_ms)), key=lambda s: -measured(s.throughput))
            others = sorted((s for s in first if not s.feasible(args.latency_budget_ms)), key=lambda s: measured(s.p99_ms))
            finalists = (feasible + others)[: args.finalists]
            for r in range(2, 2 + args.final_rounds):
                for s in finalists:
                    try_one(s.candidate, r)
            winner = pick(finalists or list(scores.values()), args.latency_budget_ms)
            if winner is not None:
                harness.reload_with(server.http_url, ENCODER, apply_candidate(base, winner.candidate))
                if args.rate_fraction > 0 and winner.throughput and state.left() > 20:
                    rate = args.rate_fraction * winner.throughput
                    rate_row = Row(
                        "winner-rate", "winner", "grpc", f"{rate:.0f}/s ({args.rate_fraction:.0%} of {winner.throughput:.0f})"
                    )
                    state.say(f"winner under Poisson arrivals at {rate_row.load}")
                    harness.point(
                        state,
                        rate_row,
                        server.grpc_url,
                        rate=rate,
                        stats_url=server.http_url,
                        stability_percent=max(args.stability_percent, 50.0),
                    )
    except ServerError as exc:
        state.say(f"    {exc}\n{exc.log_tail}")
        return 1

    head = harness.header(
        f"Autotune: {ENCODER} ({served.variant}) batching in {MODEL}",
        args,
        "autotune",
        load,
        f"perf_analyzer gRPC, concurrency {args.concurrency}, windows of {args.request_count} requests, -s "
        f"{args.stability_percent:g}; P99 budget {args.latency_budget_ms:g} ms; the best {args.finalists} of the first "
        f"pass measured {args.final_rounds} more time(s), interleaved; medians below",
    )
    table = summary_markdown(head, list(scores.values()), winner, args.latency_budget_ms, untried, rate_row)
    (state.out_dir / "summary.md").write_text(table)
    print("\n" + table, flush=True)
    if winner is None:
        state.say("perf.bench.autotune: no candidate was measured")
        return 1
    config = apply_candidate(base, winner.candidate)
    note = (
        f"# Written by `python -m perf.bench.autotune` {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC: {winner.candidate.describe()};\n"
        f"# {fmt(winner.throughput)} infer/s, p50 {fmt(winner.p50_ms)} ms, p99 {fmt(winner.p99_ms)} ms at concurrency "
        f"{args.concurrency} (summary.md beside this file).\n"
    )
    (state.out_dir / f"{ENCODER}.pbtxt").write_text(to_pbtxt(config, note))
    (state.out_dir / "override.json").write_text(json.dumps({"parameters": {"config": json.dumps(config)}}, indent=1) + "\n")
    if args.apply:
        harness.reload_with(args.apply, ENCODER, config)
        state.say(f"perf.bench.autotune: winning config loaded into {args.apply}")
    state.say(f"perf.bench.autotune: results in {display_path(state.out_dir)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
