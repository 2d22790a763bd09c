"""`python -m perf.limit`: the in-process ceiling a served text encoder is measured against.

Two figures, measured side by side in interleaved rounds (export/bench.py's method: the
median over rounds, so a noisy neighbour costs every figure alike):

- **encoder**: ONNX Runtime alone running the encoder file that Triton serves for the chosen
  precision (``--precision cpu`` = the variant configs/cpu.pbtxt serves, INT8 here; ``fp32`` =
  model.onnx), on pre-tokenized batches of the checked-in 16-token sentences, with the same
  intra-op thread count as the served config and spinning off (export.bench.open_cpu_session).
- **end to end**: the same session plus the served tokenizer (python_backends.text
  BatchTokenizer on the exported tokenizer.json) and the served pooler (mean_pool) in the same
  loop: what a perfect server with zero overhead would do per batch of texts.

Both are sequences per second per batch size; the limit is the best batch's figure.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from export import bench
from export.variants import VARIANTS, resolve_precision

PERF_DIR = Path(__file__).resolve().parent
ROOT = PERF_DIR.parent
REPOSITORY = ROOT / "model_repository"
DEFAULT_INPUT = PERF_DIR / "data" / "sentences_16tok.json"
ENCODER = "text_encoder"
TOKENIZER = "text_tokenizer"
DEFAULT_BATCHES = (1, 8, 16, 32, 64)  # 64 = the served encoder's max_batch_size


@dataclass(frozen=True)
class ServedEncoder:
    """What Triton serves as the text encoder for one PRECISION setting."""

    precision: str  # the --precision asked for (cpu, fp32, ...)
    config_name: str | None  # tritonserver --model-config-name (None = config.pbtxt)
    variant: str  # fp32, int8, ...
    model_path: Path
    threads: int  # ONNX Runtime intra-op threads the served config gives the encoder


@dataclass
class Limit:
    served: ServedEncoder
    encoder: bench.Speed  # ONNX Runtime alone, sequences/s by batch size
    end_to_end: bench.Speed  # tokenizer + encoder + pooler, sequences/s by batch size

    def rows(self) -> list[dict[str, object]]:
        out = []
        for kind, speed in (("encoder", self.encoder), ("end_to_end", self.end_to_end)):
            for batch, value in speed.throughput.items():
                out.append({"kind": kind, "variant": self.served.variant, "threads": self.served.threads,
                            "batch": batch, "sequences_per_s": round(value, 1)})
        return out


def config_parameter(config_text: str, key: str) -> str | None:
    """The string_value of ``parameters { key: "<key>" ... }`` in a config.pbtxt text, or None.

    When a key appears twice (a generated variant config may append an override), the last
    one wins, as in Triton's parsed config (a protobuf map).
    """
    pattern = r'parameters\s*\{\s*key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"'
    found = re.findall(pattern, config_text)
    return found[-1] if found else None


def served_config_text(repo: Path, model: str, config_name: str | None) -> str:
    """The config.pbtxt Triton reads for ``model`` under --model-config-name=config_name."""
    variant = repo / model / "configs" / f"{config_name}.pbtxt" if config_name else None
    return (variant if variant is not None and variant.is_file() else repo / model / "config.pbtxt").read_text()


def served_encoder(precision: str, repo: Path = REPOSITORY) -> ServedEncoder:
    """Resolve PRECISION as the server does (export.variants) to the encoder file and thread count."""
    config_name, served = resolve_precision(repo, [ENCODER], precision)
    variant = served[ENCODER]
    text = served_config_text(repo, ENCODER, config_name)
    # Triton's (and ONNX Runtime's) 0 = one thread per core; the same here.
    threads = int(config_parameter(text, "intra_op_thread_count") or 0) or bench.cpu_threads()
    return ServedEncoder(precision, config_name, variant, repo / ENCODER / "1" / VARIANTS[variant].filename, threads)


def load_sentences(path: Path = DEFAULT_INPUT) -> list[str]:
    """The texts of a perf_analyzer input-data JSON ({"data": [{"TEXT": {"content": [..]}}]})."""
    data = json.loads(Path(path).read_text())["data"]
    return [text for entry in data for text in entry["TEXT"]["content"]]


def served_tokenizer(repo: Path = REPOSITORY):
    """The tokenizer step's BatchTokenizer, configured from text_tokenizer/config.pbtxt."""
    from python_backends.text.tokenization import DEFAULT_BUCKETS, BatchTokenizer

    text = (repo / TOKENIZER / "config.pbtxt").read_text()
    file = config_parameter(text, "tokenizer_file") or "tokenizer.json"
    max_length = int(config_parameter(text, "max_sequence_length") or 256)
    buckets_text = config_parameter(text, "sequence_buckets")
    buckets = [int(b) for b in buckets_text.split(",")] if buckets_text else list(DEFAULT_BUCKETS)
    return BatchTokenizer(repo / TOKENIZER / "1" / file, max_length, buckets)


def _rate(run: Callable[[], object], items: int, seconds: float, min_runs: int = 3) -> tuple[float, float]:
    """(items per second, median seconds per run) of ``run`` repeated for about ``seconds``."""
    times = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_runs or time.perf_counter() < deadline:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return items * len(times) / sum(times), statistics.median(times)


def measure(
    served: ServedEncoder,
    texts: Sequence[str],
    batches: Sequence[int] = DEFAULT_BATCHES,
    rounds: int = 3,
    seconds: float = 1.0,
    repo: Path = REPOSITORY,
    progress: Callable[[str], None] | None = None,
) -> Limit:
    """Encoder-only and end-to-end in-process throughput per batch size, interleaved rounds."""
    from python_backends.text.pooling import mean_pool

    if not served.model_path.is_file():
        raise FileNotFoundError(f"{served.model_path} not found (run `make export`)")
    session = bench.open_cpu_session(served.model_path, served.threads)
    tokenizer = served_tokenizer(repo)
    batches = sorted(set(batches) | {1})
    batch_texts = {b: [texts[i % len(texts)] for i in range(b)] for b in batches}
    feeds = {}
    for b, chunk in batch_texts.items():
        enc = tokenizer.encode(chunk)
        feeds[b] = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}

    def encoder_only(b: int) -> Callable[[], object]:
        return lambda: session.run(None, feeds[b])

    def end_to_end(b: int) -> Callable[[], object]:
        def run() -> np.ndarray:
            enc = tokenizer.encode(batch_texts[b])
            (hidden,) = session.run(None, {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})
            return mean_pool(hidden, enc.attention_mask)

        return run

    kinds = {"encoder": encoder_only, "end_to_end": end_to_end}
    for b in batches:  # warm-up: first runs allocate and pick kernels
        for make in kinds.values():
            make(b)()
    rates: dict[str, dict[int, list[float]]] = {k: {b: [] for b in batches} for k in kinds}
    latency: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        if progress:
            progress(f"limit round {r + 1}/{rounds}: batches {', '.join(map(str, batches))}")
        for b in batches:
            for kind, make in kinds.items():
                rate, median_s = _rate(make(b), b, seconds)
                rates[kind][b].append(rate)
                if b == 1:
                    latency[kind].append(median_s * 1e3)
    speeds = {
        kind: bench.Speed(statistics.median(latency[kind]), {b: statistics.median(v) for b, v in rates[kind].items()})
        for kind in kinds
    }
    return Limit(served, speeds["encoder"], speeds["end_to_end"])


def markdown(limit: Limit) -> str:
    s = limit.served
    lines = [
        f"In-process limit: {ENCODER} variant `{s.variant}` ({s.model_path.name}), ONNX Runtime, "
        f"{s.threads} intra-op threads, spinning off, 16-token sentences.",
        "",
        "| batch | encoder only (seq/s) | tokenizer + encoder + pooler (seq/s) |",
        "| ---: | ---: | ---: |",
    ]
    for b in limit.encoder.throughput:
        lines.append(f"| {b} | {limit.encoder.throughput[b]:.0f} | {limit.end_to_end.throughput[b]:.0f} |")
    lines.append(
        f"| best | {limit.encoder.best_throughput:.0f} (batch {limit.encoder.best_batch}) | "
        f"{limit.end_to_end.best_throughput:.0f} (batch {limit.end_to_end.best_batch}) |"
    )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.limit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", default="cpu", help="as PRECISION of `make serve`: cpu (default), fp32, int8, ...")
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0, help="per batch size, kind and round")
    p.add_argument("--input-data", type=Path, default=DEFAULT_INPUT)
    args = p.parse_args(argv)
    served = served_encoder(args.precision)
    limit = measure(served, load_sentences(args.input_data), [int(b) for b in args.batches.split(",")],
                    rounds=args.rounds, seconds=args.seconds, progress=lambda m: print(m, flush=True))
    print(markdown(limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
