"""`python -m perf.bench.length_mix`: mixed-length traffic served against its in-process limit.

Texts of 8-128 tokens (``--mix``) at ``--concurrency`` 32 connections, one per HTTP request, to
``text_encoder`` (token ids, unpadded) and ``text_embedding`` (unique texts). Two tritonservers side
by side (CPU variants, no front door): ``after``, the shipped configs (``allow_ragged_batch`` and a
``max_batch_tokens`` budget: the backend groups rows by length, python_backends.onnx_engine.batching);
``before``, a linked copy without both (export.variants.drop_ragged, what a GPU variant serves).
Phases interleave over ``--rounds`` rounds of ``--duration`` s (perf.bench.tail's windows; medians); each figure is a
ratio to the in-process limit for the same mix (perf.baselines.limit.measure_length_mix). ``--url
HOST:PORT`` measures one running server (no limit unless ``--limit-rounds``). Writes length_mix.csv,
limit.csv and summary.md under perf/results/length-mix-<UTC>/.
"""

from __future__ import annotations

import argparse
import itertools
import random
import secrets
import signal
import sys
import types
from collections.abc import Sequence
from pathlib import Path

from perf.baselines import limit as limit_mod
from perf.bench.tail_measure import Window, Workload, measure, warm_up, wrk_script
from perf.lib import lifecycle, load, options, report, wrk
from perf.lib import served as served_mod
from perf.lib.paths import ROOT  # noqa: F401 - the shipped repository, beside before_repository's copy
from perf.lib.report import load_average, progress, table
from perf.lib.workload import infer_body, text_request

WORKLOADS = ("text_encoder", "text_embedding")
MODELS = ("text_embedding",)  # the ensemble loads the tokenizer and the encoder
HEADERS = {"Content-Type": "application/json"}


def token_body(ids: Sequence[int]) -> bytes:
    """text_encoder's request for one row of token ids, as long as the row (unpadded)."""
    n = len(ids)
    inputs = [("input_ids", list(ids)), ("attention_mask", [1] * n)]
    return infer_body([{"name": k, "shape": [1, n], "datatype": "INT64", "data": v} for k, v in inputs])[0]


def mixed_texts(lengths: Sequence[int], tokenizer, seed: int = 0) -> list[str]:
    """One text per length whose tokenization (with [CLS], [SEP] and a request number of up to
    4 tokens put in front later) is about that long: words from a fixed list, as many as fit
    (a space-separated text tokenizes to the sum of its words' tokens)."""
    words = (
        "serving models under load keeps the tail of latency short when batches form from requests of similar "
        "length and the encoder runs fewer padded tokens per call"
    ).split()
    cost = dict(zip(words, (int(n) - 2 for n in tokenizer.encode(words).lengths)))
    rng = random.Random(seed)
    out = []
    for n in lengths:
        chosen: list[str] = []
        used, target = 0, max(1, n - 6)
        while True:
            word = rng.choice(words)
            if chosen and used + cost[word] > target:
                break
            chosen.append(word)
            used += cost[word]
        out.append(" ".join(chosen))
    return out


def workloads(mix: tuple[int, int], nonce: str, seed: int = 0, pool: int = 2000) -> dict[str, Workload]:
    """perf.bench.tail's workloads of the mix: token ids (cycled) and texts made unique by a number in front."""
    lengths = limit_mod.mix_lengths(pool, *mix, seed=seed)
    rows = [token_body(r.tolist()) for r in limit_mod.token_rows(lengths, seed=seed)]
    texts = mixed_texts(lengths, served_mod.served_tokenizer(), seed=seed)
    numbers = itertools.count()

    def text(_: int) -> tuple[bytes, dict[str, str]]:  # unique: Triton's response cache never answers
        n = next(numbers)
        return text_request(f"{nonce}{n} {texts[n % pool]}")[0], HEADERS

    return {
        "text_encoder": Workload(
            "text_encoder", "text_encoder", "mix", lambda i: (rows[i % pool], HEADERS), lua=wrk.cycle(rows[:500])
        ),
        "text_embedding": Workload(
            "text_embedding",
            "text_embedding",
            "mix",
            text,
            lua=wrk.unique_texts(texts, text_request("\0")[0], nonce, before=True),
        ),
    }


def before_repository(source: Path, target: Path) -> Path:
    """``source``'s models at ``target`` (files linked) with text_encoder's configs not ragged."""
    from export.variants import drop_ragged

    return lifecycle.linked_repository(
        source, target, lambda model, _, text: drop_ragged(text) if model == "text_encoder" else None
    )


def _f(value, digits: int = 1) -> str:
    return report.fmt(value, digits, missing="-")


def encoder_rows(w: Window) -> float | None:
    """text_encoder's rows per execution over the window (Triton's statistics)."""
    return w.stats.get("text_encoder", {}).get("batch")


def markdown(header: Sequence[str], results: Sequence[Window], mix_limit) -> str:
    limit_rps = mix_limit.best[2] if mix_limit else None
    rows = [
        (p.workload, p.phase, p.concurrency, _f(p.rps, 0), _f(p.rps / limit_rps if p.rps and limit_rps else None, 2))
        + (_f(p.p50_ms), _f(p.p99_ms), _f(p.max_ms), _f(encoder_rows(p)), p.errors)
        for p in sorted(results, key=lambda p: (p.workload, p.concurrency, p.phase))
    ]
    columns = ["workload", "phase", "conc", "req/s", "ratio to limit", "P50 ms", "P99 ms", "max ms", "encoder rows/execution"]
    lines = [*header, "", table([*columns, "errors"], rows, left=2)]
    if mix_limit is not None:
        lines += ["", limit_mod.mix_markdown(mix_limit)]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = options.parser("perf.bench.length_mix", __doc__)
    p.add_argument(
        "--workloads",
        type=options.choices(WORKLOADS),
        default=list(WORKLOADS),
        help=f"comma-separated, of: {', '.join(WORKLOADS)}",
    )
    mix = f"{limit_mod.DEFAULT_MIX[0]}-{limit_mod.DEFAULT_MIX[1]}"
    p.add_argument("--mix", default=mix, metavar="LOW-HIGH", help="tokens per text, drawn uniformly (default 8-128)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument(
        "--phases",
        type=options.choices(("after", "before")),
        default=["after", "before"],
        help="comma-separated, of: after, before",
    )
    p.add_argument("--url", help="HOST:PORT of a running tritonserver's HTTP endpoint: measure it alone (phase url)")
    options.add_run(p, "length-mix", rounds=3, duration=8.0, warmup=2.0)
    limit_help = "rounds of the in-process limit (default 3; 0 skips it; with --url default 0)"
    p.add_argument("--limit-rounds", type=int, default=None, help=limit_help)
    p.add_argument("--limit-seconds", type=float, default=1.0)
    p.add_argument("--limit-pool", type=int, default=512)
    budgets = ",".join(map(str, limit_mod.DEFAULT_BUDGETS))
    p.add_argument("--budgets", default=budgets, help="token budgets the limit tries (comma-separated)")
    options.add_client(p)
    args = p.parse_args(argv)
    args.workload_list = args.workloads
    args.mix_range = tuple(int(x) for x in args.mix.split("-"))
    args.phase_list = ["url"] if args.url else args.phases
    if args.limit_rounds is None:
        args.limit_rounds = 0 if args.url else 3
    return options.finish(p, args, argv)


def run(args: argparse.Namespace) -> int:
    # SIGTERM (a timeout, a CI cancel) raises, so the servers are stopped in ``finally``.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    say = progress()

    out_dir = report.results_dir(args.out_dir, "length-mix")
    served = served_mod.served_encoder(args.precision)
    load_avg = load_average()
    work = workloads(args.mix_range, secrets.token_hex(4))
    windows: list[Window] = []
    phases = [] if args.url else args.phase_list
    started = lifecycle.side_by_side(phases, MODELS, out_dir, say, before_repository, model_config_name=served.config_name)
    with started as (servers, workdir):
        if servers is None:
            return 1
        if args.url:  # a running server: no process of its own to meter
            servers = {"url": types.SimpleNamespace(triton_http_url=args.url, process=None)}
        scripts = {name: workdir / f"{name}.lua" for name in args.workload_list if args.use_wrk}
        for name, script in scripts.items():
            script.write_text(wrk_script(work[name], [], ""))
        for name in args.workload_list:
            for rnd, phase in lifecycle.interleaved(args.phase_list, args.rounds):
                window = Window(phase, name, args.concurrency, rnd, "wrk" if args.use_wrk else "python")
                warm_up(servers[phase], None, work[name], args.concurrency, args.warmup, scripts.get(name))
                measure(window, work[name], servers[phase], None, scripts.get(name), args.duration)
                windows.append(window)
                say(f"{window.line()}  encoder rows/execution {_f(encoder_rows(window))}")

    mix_limit = None
    if args.limit_rounds > 0:
        say(f"in-process limit for {args.mix}: {args.limit_rounds} rounds")
        mix_limit = limit_mod.measure_length_mix(
            served,
            args.mix_range,
            [int(b) for b in args.budgets.split(",")],
            pool=args.limit_pool,
            rounds=args.limit_rounds,
            seconds=args.limit_seconds,
            progress=say,
        )
    results = load.points(windows)
    header = [
        *report.header("Mixed-length traffic against its in-process limit", "perf.bench.length_mix", args.argv, load_avg),
        (
            f"- {args.mix} tokens per text, one text per HTTP request, {args.concurrency} connections; phases "
            f"{', '.join(args.phase_list)} interleaved in {args.rounds} rounds of {args.duration:g} s (after "
            f"{args.warmup:g} s warm-up); client {'wrk (1 thread)' if args.use_wrk else 'asyncio'}; encoder variant "
            f"{served.variant}; ratio = served req/s over the limit's seq/s"
        ),
    ]
    csvs = {"length_mix.csv": [w.record() for w in windows], "limit.csv": mix_limit.rows() if mix_limit else []}
    report.write(out_dir, markdown(header, results, mix_limit), csvs=csvs, say=say)
    errors = sum(p.errors for p in results)
    return 1 if errors or not windows else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
