"""`python -m perf.baselines.limit`: the in-process ceiling a served text encoder is measured against.

ONNX Runtime running the encoder file Triton serves for ``--precision`` (spinning off), alone on
pre-tokenized 16-token sentences (**encoder**) and with the served tokenizer in the loop (**end to
end**; pooling is in the graph), sequences/s per batch size, in interleaved rounds (the median, so a
noisy neighbour costs every figure alike). Each in the served thread layout (the config's instances,
each a session with its intra-op threads, all at once) and as one session with a thread per core;
per batch size the faster layout counts, so a wasteful served layout is not flattered.

``measure_length_mix``: the limit for a seeded pool of rows of mixed token lengths, grouped as the served
encoder does (sorted, cut under each token budget: plan_runs), against runs of a fixed count of rows
padded to their bucket, and against every row alone (perf.bench.length_mix reports it).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from export import bench
from perf.lib import options
from perf.lib.report import table
from perf.lib.served import DEFAULT_INPUT, ENCODER, REPOSITORY, ServedEncoder, load_sentences, served_encoder, served_tokenizer

DEFAULT_BATCHES = (1, 8, 16, 32, 64)  # 64 = the served encoder's max_batch_size


@dataclass
class Limit:
    served: ServedEncoder
    encoder: bench.Speed  # ONNX Runtime alone, sequences/s by batch size (faster layout per batch)
    end_to_end: bench.Speed  # tokenizer + encoder (pooling in the graph), sequences/s by batch size
    # layout ("<sessions>x<threads>") -> kind ("encoder", "end_to_end") -> speed
    layouts: dict[str, dict[str, bench.Speed]] = field(default_factory=dict)

    def best_layout(self, kind: str = "encoder") -> str:
        """The layout of the best batch's figure."""
        speed = getattr(self, kind)
        batch = speed.best_batch
        return max(self.layouts, key=lambda name: self.layouts[name][kind].throughput.get(batch, 0.0))

    def rows(self) -> list[dict[str, object]]:
        return [
            {"kind": kind, "variant": self.served.variant, "layout": layout, "batch": batch, "sequences_per_s": round(value, 1)}
            for layout, kinds in self.layouts.items()
            for kind, speed in kinds.items()
            for batch, value in speed.throughput.items()
        ]


def _rate(runs: Sequence[Callable[[], object]], items: int, seconds: float, min_runs: int = 3) -> tuple[float, float]:
    """(items per second, median seconds per run) of the ``runs``, each repeated in its own thread
    for about ``seconds``, all at once (ONNX Runtime and the tokenizer release the GIL)."""
    times: list[list[float]] = [[] for _ in runs]
    start_line = threading.Barrier(len(runs))

    def loop(i: int) -> None:
        start_line.wait()
        deadline = time.perf_counter() + seconds
        while len(times[i]) < min_runs or time.perf_counter() < deadline:
            start = time.perf_counter()
            runs[i]()
            times[i].append(time.perf_counter() - start)

    if len(runs) == 1:
        loop(0)
    else:
        workers = [threading.Thread(target=loop, args=(i,)) for i in range(len(runs))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    rate = sum(items * len(t) / sum(t) for t in times)
    return rate, statistics.median(x for t in times for x in t)


def layouts(served: ServedEncoder, cores: int | None = None) -> list[tuple[int, int]]:
    """(sessions, intra-op threads each): the served layout and one session over all cores."""
    cores = cores or bench.cpu_threads()
    out = [(served.instances, served.threads)]
    if (1, cores) not in out:
        out.append((1, cores))
    return out


def _interleaved(
    served: ServedEncoder,
    work: dict[str, tuple[Callable[[Any, int], Callable[[], object]], int]],
    rounds: int,
    seconds: float,
    min_runs: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, tuple[float, float]]]:
    """{layout: {label: (median items/s, median seconds per run)}} of each ``work`` label (a maker of one
    session's run, given the session and its number, and the items a run does), per thread layout,
    in interleaved rounds after one warm-up run of each."""
    if not served.model_path.is_file():
        raise FileNotFoundError(f"{served.model_path} not found (run `make export`)")
    sessions = {f"{n}x{t}": [bench.open_cpu_session(served.model_path, t) for _ in range(n)] for n, t in layouts(served)}
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {lay: {label: [] for label in work} for lay in sessions}
    for group in sessions.values():  # warm-up: first runs allocate and pick kernels
        for make, _ in work.values():
            for i, session in enumerate(group):
                make(session, i)()
    for r in range(rounds):
        if progress:
            progress(f"limit round {r + 1}/{rounds}: {len(work)} runs x layouts {', '.join(sessions)} (sessions x threads)")
        for label, (make, items) in work.items():
            for lay, group in sessions.items():
                samples[lay][label].append(_rate([make(s, i) for i, s in enumerate(group)], items, seconds, min_runs))
    return {
        lay: {label: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for label, v in by.items()}
        for lay, by in samples.items()
    }


def measure(
    served: ServedEncoder,
    texts: Sequence[str],
    batches: Sequence[int] = DEFAULT_BATCHES,
    rounds: int = 3,
    seconds: float = 1.0,
    repo: Path = REPOSITORY,
    progress: Callable[[str], None] | None = None,
) -> Limit:
    """Encoder-only and end-to-end in-process throughput per batch size and thread layout; per kind and
    batch size the faster layout counts."""
    tokenizers = [served_tokenizer(repo) for _ in range(max(n for n, _ in layouts(served)))]
    batches = sorted(set(batches) | {1})
    batch_texts = {b: [texts[i % len(texts)] for i in range(b)] for b in batches}
    feeds = {}
    for b, chunk in batch_texts.items():
        enc = tokenizers[0].encode(chunk)
        feeds[b] = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}

    def encoder_only(b: int) -> Callable[[Any, int], Callable[[], object]]:
        return lambda session, i: lambda: session.run(None, feeds[b])

    def end_to_end(b: int) -> Callable[[Any, int], Callable[[], object]]:
        def make(session, i: int) -> Callable[[], object]:
            def run() -> object:
                enc = tokenizers[i].encode(batch_texts[b])
                return session.run(None, {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})

            return run

        return make

    kinds = {"encoder": encoder_only, "end_to_end": end_to_end}
    work = {f"{kind} {b}": (make(b), b) for b in batches for kind, make in kinds.items()}
    result = _interleaved(served, work, rounds, seconds, progress=progress)
    per_layout = {
        lay: {kind: bench.Speed(by[f"{kind} 1"][1] * 1e3, {b: by[f"{kind} {b}"][0] for b in batches}) for kind in kinds}
        for lay, by in result.items()
    }
    served_name = f"{served.instances}x{served.threads}"
    best = {
        kind: bench.Speed(
            per_layout[served_name][kind].latency_ms_b1,
            {b: max(per_layout[n][kind].throughput[b] for n in per_layout) for b in batches},
        )
        for kind in kinds
    }
    return Limit(served, best["encoder"], best["end_to_end"], per_layout)


DEFAULT_MIX = (8, 128)  # tokens per text, as in the mixed-length traffic of the tail benchmark
DEFAULT_BUDGETS = (512, 1024, 2048, 4096)
BUCKETS = (16, 32, 64, 128, 256)  # text_tokenizer's sequence_buckets


def mix_lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    """``n`` lengths drawn uniformly from low..high (inclusive), reproducibly."""
    if not 2 <= low <= high:
        raise ValueError(f"a length mix needs 2 <= low <= high, got {low}-{high}")
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def token_rows(lengths: Sequence[int], seed: int = 0, vocab: tuple[int, int] = (1000, 30000)) -> list[np.ndarray]:
    """One row of token ids per length: [CLS] random ids [SEP] (ids inside the vocabulary)."""
    rng = np.random.default_rng(seed)
    return [np.concatenate(([101], rng.integers(*vocab, size=n - 2), [102])).astype(np.int64) for n in lengths]


def _feed(rows: Sequence[np.ndarray], width: int) -> dict[str, np.ndarray]:
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for k, row in enumerate(rows):
        ids[k, : len(row)] = row
        mask[k, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def grouped_feeds(rows: Sequence[np.ndarray], max_tokens: int, max_padding: int = 0) -> list[dict[str, np.ndarray]]:
    """The pool as the served encoder groups it under a token budget (plan_runs)."""
    from python_backends.onnx_engine.batching import plan_runs

    runs = plan_runs([len(r) for r in rows], max_tokens, max_padding=max_padding)
    return [_feed([rows[i] for i in run], len(rows[run[0]])) for run in runs]


def count_feeds(rows: Sequence[np.ndarray], batch: int, buckets: Sequence[int] = BUCKETS) -> list[dict[str, np.ndarray]]:
    """The pool in runs of ``batch`` rows in arrival order, each padded to the bucket of its longest row."""
    from contract.model_config import bucket_length

    chunks = [rows[i : i + batch] for i in range(0, len(rows), batch)]
    return [_feed(c, bucket_length(max(len(r) for r in c), buckets)) for c in chunks]


@dataclass
class MixLimit:
    served: ServedEncoder
    mix: tuple[int, int]
    pool: int
    mean_tokens: float
    # layout -> grouping ("tokens<=B" or "count=N") -> sequences/s (median over rounds)
    rates: dict[str, dict[str, float]]

    @property
    def best(self) -> tuple[str, str, float]:
        """(layout, grouping, sequences/s) of the fastest grouping and layout: the limit."""
        return max(((lay, g, v) for lay, gs in self.rates.items() for g, v in gs.items()), key=lambda x: x[2])

    def best_budget(self) -> int | None:
        """The token budget of the fastest token-budget grouping."""
        best = max(
            ((g, v) for gs in self.rates.values() for g, v in gs.items() if g.startswith("tokens")),
            key=lambda x: x[1],
            default=None,
        )
        return int(best[0].split("<=")[1]) if best else None

    def rows(self) -> list[dict[str, object]]:
        return [
            {
                "kind": "length_mix",
                "variant": self.served.variant,
                "layout": lay,
                "grouping": g,
                "mix": f"{self.mix[0]}-{self.mix[1]}",
                "sequences_per_s": round(v, 1),
            }
            for lay, gs in self.rates.items()
            for g, v in gs.items()
        ]


def measure_length_mix(
    served: ServedEncoder,
    mix: tuple[int, int] = DEFAULT_MIX,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    count_batch: int = 16,
    pool: int = 512,
    rounds: int = 3,
    seconds: float = 1.0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> MixLimit:
    """In-process sequences/s on a mixed-length pool, per grouping and thread layout, interleaved rounds."""
    lengths = mix_lengths(pool, *mix, seed=seed)
    rows = token_rows(lengths, seed=seed)
    groupings = {f"tokens<={b}": grouped_feeds(rows, b) for b in budgets}
    groupings[f"count={count_batch}"] = count_feeds(rows, count_batch)
    groupings["alone"] = [_feed([r], len(r)) for r in rows]  # each row its own run, unpadded

    def whole_pool(feeds: list[dict[str, np.ndarray]]) -> Callable[[Any, int], Callable[[], object]]:
        return lambda session, i: lambda: [session.run(None, f) for f in feeds]

    work = {g: (whole_pool(feeds), len(rows)) for g, feeds in groupings.items()}
    result = _interleaved(served, work, rounds, seconds, min_runs=1, progress=progress)
    rates = {lay: {g: rate for g, (rate, _) in by.items()} for lay, by in result.items()}
    return MixLimit(served, (mix[0], mix[1]), pool, float(np.mean(lengths)), rates)


def mix_markdown(m: MixLimit) -> str:
    s, names = m.served, list(m.rates)
    layout, grouping, value = m.best
    rows = [[g, *(f"{m.rates[n][g]:.0f}" for n in names)] for g in next(iter(m.rates.values()))]
    return (
        "\n".join(
            [
                f"In-process limit for mixed lengths: {ENCODER} variant `{s.variant}` ({s.model_path.name}), ONNX Runtime, "
                f"spinning off; {m.pool} rows of {m.mix[0]}-{m.mix[1]} tokens (mean {m.mean_tokens:.1f}); "
                f"layouts as sessions x intra-op threads (served: {s.layout}).",
                "",
                table(["grouping", *(f"{n} (seq/s)" for n in names)], rows),
                "",
                f"limit: {value:.0f} seq/s (grouping {grouping}, layout {layout}); best token budget: {m.best_budget()}",
            ]
        )
        + "\n"
    )


def markdown(limit: Limit) -> str:
    s, names = limit.served, list(limit.layouts)
    columns = [f"{kind} {n} (seq/s)" for n in names for kind in ("encoder", "tokenizer + encoder")]
    rows = [
        [b, *(f"{limit.layouts[n][kind].throughput[b]:.0f}" for n in names for kind in ("encoder", "end_to_end"))]
        for b in limit.encoder.throughput
    ]
    best = [
        f"{speed.best_throughput:.0f} (batch {speed.best_batch}, {limit.best_layout(kind)})"
        for kind, speed in (("encoder", limit.encoder), ("end_to_end", limit.end_to_end))
    ]
    return (
        "\n".join(
            [
                f"In-process limit: {ENCODER} variant `{s.variant}` ({s.model_path.name}), ONNX Runtime, spinning off, "
                f"16-token sentences; layouts as sessions x intra-op threads (served: {s.layout}).",
                "",
                table(["batch", *columns], rows, left=0),
                "",
                table(["limit", "encoder only (seq/s)", "tokenizer + encoder (seq/s)"], [["best", *best]]),
            ]
        )
        + "\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = options.parser("perf.baselines.limit", __doc__)
    p.add_argument("--precision", default="cpu", help="as PRECISION of `make serve`: cpu (default), fp32, int8, ...")
    p.add_argument("--batches", type=options.int_list, default=list(DEFAULT_BATCHES), help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0, help="per batch size, kind and round")
    p.add_argument("--input-data", type=Path, default=DEFAULT_INPUT)
    args = p.parse_args(argv)
    texts = load_sentences(args.input_data)
    say = lambda m: print(m, flush=True)  # noqa: E731
    print(markdown(measure(served_encoder(args.precision), texts, args.batches, args.rounds, args.seconds, progress=say)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
