"""Prompt-lookup speculative decoding on and off, side by side: does it pay, and where.

Two in-process engines share one set of weights (the precision ``PRECISION`` serves, default
auto) and differ only in ``num_speculative_tokens``; requests alternate between them, so the
machine's noise falls on both. Two kinds of prompts, greedy, ``--max-tokens`` new tokens each:

- **quote**: answers that repeat their prompt (copy a passage, return a program with a comment
  added), built from the checked-in held-out texts of the generation gate, in several
  languages and code: what prompt lookup is for;
- **chat**: the checked-in chat prompts of ``perf/data/generation_prompts.json``: ordinary answers,
  where drafts are rarely right and the question is what they cost.

Each kind runs at 1 and 2 streams (``--streams``). Printed per cell: tokens/s, time per output
token (P50 over requests), the gap between two streamed outputs (P99, max), steps per token,
draft tokens accepted, and how many outputs are token for token the same as without drafts
(always all of them with FP32 weights; the 4-bit kernel rounds a few rows differently from one
row, so a near-tie may go the other way, as batch composition does without drafts). Then the
ratios drafts / none with the verdict the engine's default rests on (docs/generation-internals.md#speculative-decoding).

    python -m perf.bench.speculative_bench [--precision auto] [--max-tokens 128] [--k 3] [--requests 8]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perf.lib import report
from perf.lib.harness import write_csv
from perf.lib.paths import GENERATION_PROMPTS, ROOT
from perf.lib.stats import percentile_of

MODEL = "text_generation"
MODEL_DIR = ROOT / "model_repository" / MODEL / "1"
HELDOUT = ROOT / "export" / "data" / "generation_heldout.json"
CHAT = GENERATION_PROMPTS
# What "pays" means here: quoting answers at least this much faster, ordinary ones no slower than this.
TARGET_QUOTE = 1.3
FLOOR_CHAT = 0.95


def quote_prompts(tokenizer) -> list[str]:
    texts = json.loads(HELDOUT.read_text(encoding="utf-8"))["texts"]
    out = []
    for t in texts:
        if t["name"] in ("python", "javascript"):
            ask = "Add one comment line at the top of this code and return the whole code, otherwise unchanged:\n\n"
        else:
            ask = "Copy the following text exactly, word for word:\n\n"
        out.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": ask + t["text"]}], tokenize=False, add_generation_prompt=True
            )
        )
    return out


def chat_prompts(tokenizer, n: int) -> list[str]:
    entries = [e for e in json.loads(CHAT.read_text(encoding="utf-8"))["prompts"] if e["kind"] != "long"]
    step = max(1, len(entries) // n)
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": e["text"]}], tokenize=False, add_generation_prompt=True)
        for e in entries[::step][:n]
    ]


def run_together(engine, prompts: Sequence[str], max_tokens: int, tag: str) -> dict[str, Any]:
    """Run ``prompts`` at once to completion; per request the output ids and arrival times."""
    from python_backends.generation.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    steps0 = engine.counters["steps"]
    drafted0, accepted0 = engine.counters["spec_draft_tokens"], engine.counters["spec_accepted_tokens"]
    start = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    arrivals: dict[str, list[tuple[float, int]]] = {rid: [] for rid in ids}  # (time, tokens that arrived)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.token_ids:
                tokens[out.request_id].extend(out.token_ids)
                arrivals[out.request_id].append((now, len(out.token_ids)))
    wall = time.perf_counter() - start
    return {
        "tokens": [tokens[r] for r in ids],
        "arrivals": [arrivals[r] for r in ids],
        "wall": wall,
        "steps": engine.counters["steps"] - steps0,
        "drafted": engine.counters["spec_draft_tokens"] - drafted0,
        "accepted": engine.counters["spec_accepted_tokens"] - accepted0,
    }


def summarise(runs: Sequence[dict]) -> dict[str, float]:
    n_tokens = sum(len(t) for r in runs for t in r["tokens"])
    tpot, gaps = [], []
    for r in runs:
        for arr in r["arrivals"]:
            if len(arr) >= 2:
                produced = sum(n for _, n in arr[1:])
                tpot.append((arr[-1][0] - arr[0][0]) / produced * 1e3)
                gaps += [(b[0] - a[0]) * 1e3 for a, b in itertools.pairwise(arr)]
    gaps.sort()
    drafted = sum(r["drafted"] for r in runs)
    return {
        "tokens_per_s": n_tokens / sum(r["wall"] for r in runs),
        "tpot_p50_ms": statistics.median(tpot) if tpot else float("nan"),
        "gap_p99_ms": percentile_of(gaps, 99),
        "gap_max_ms": gaps[-1] if gaps else float("nan"),
        "steps_per_token": sum(r["steps"] for r in runs) / max(1, n_tokens),
        "drafted": drafted,
        "acceptance": sum(r["accepted"] for r in runs) / drafted if drafted else 0.0,
        "tokens": n_tokens,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m perf.bench.speculative_bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--precision",
        default=os.environ.get("PRECISION", "auto"),
        help="weights precision as PRECISION names it (default $PRECISION or auto)",
    )
    p.add_argument("--k", type=int, default=3, help="draft tokens per step (num_speculative_tokens, default 3)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--requests", type=int, default=8, help="requests per kind and stream count (default 8)")
    p.add_argument("--streams", default="1,2", help="concurrent requests per cell (default 1,2)")
    p.add_argument("--out-dir", type=Path, default=None, help="results folder (default perf/results/speculative-<UTC>)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from perf.lib.generation_systems import resolve_precision, served_engine_settings
    from python_backends.generation.engine import EngineConfig, LLMEngine
    from python_backends.generation.model_runner import DTYPES, LlamaWeights

    repository = MODEL_DIR.parent.parent
    config_name, precision = resolve_precision(repository, args.precision)
    settings = served_engine_settings(repository, config_name)
    settings.update(num_blocks=1024, max_num_seqs=8)
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    weights = LlamaWeights.from_folder(MODEL_DIR, DTYPES[settings.get("dtype", "float32")], "cpu", precision)
    engines = {
        name: LLMEngine(
            EngineConfig(model_dir=str(MODEL_DIR), **{**settings, "num_speculative_tokens": k, "speculative_max_seqs": 2}),
            weights=weights,
            tokenizer=tok,
        )
        for name, k in (("none", 0), ("drafts", args.k))
    }
    out_dir = report.results_dir(args.out_dir, "speculative")
    kinds = {"quote": quote_prompts(tok), "chat": chat_prompts(tok, args.requests)}
    streams = [int(s) for s in args.streams.split(",")]
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(
        f"perf.bench.speculative_bench: weights {precision}, k={args.k}, {args.max_tokens} new tokens, load average {load}",
        flush=True,
    )
    for e in engines.values():  # warm both (first-call allocations)
        run_together(e, kinds["chat"][:1], 4, "warm")
    rows: list[dict[str, Any]] = []
    same: dict[tuple[str, int], tuple[int, int]] = {}  # (kind, streams) -> (same tokens, tokens)
    for kind, prompts in kinds.items():
        prompts = (prompts * args.requests)[: args.requests]
        for s in streams:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
            for i in range(0, len(prompts), s):
                group = prompts[i : i + s]
                order = list(engines) if (i // s) % 2 == 0 else list(reversed(engines))
                for name in order:
                    runs[name].append(run_together(engines[name], group, args.max_tokens, f"{kind}-{s}-{i}"))
            outs = {name: [t for r in rs for t in r["tokens"]] for name, rs in runs.items()}
            same[(kind, s)] = sum(a == b for a, b in zip(outs["none"], outs["drafts"])), len(outs["none"])
            for name, rs in runs.items():
                row = {"kind": kind, "streams": s, "engine": name, **summarise(rs)}
                rows.append(row)
                print(
                    f"  {kind:5} {s} stream(s) {name:6}: {row['tokens_per_s']:6.1f} tokens/s, TPOT P50 "
                    f"{row['tpot_p50_ms']:5.1f} ms, gap P99 {row['gap_p99_ms']:5.1f} max {row['gap_max_ms']:5.1f} ms, "
                    f"{row['steps_per_token']:.2f} steps/token, {row['acceptance']:.0%} of {row['drafted']} drafted "
                    f"accepted",
                    flush=True,
                )
    write_csv(out_dir / "speculative.csv", rows)
    by = {(r["kind"], r["streams"], r["engine"]): r for r in rows}
    lines = [
        (f"# Prompt-lookup drafts on / off ({precision} weights, k={args.k}, {args.max_tokens} new tokens, load average {load})"),
        "",
        (
            "| kind | streams | tokens/s none | tokens/s drafts | ratio | TPOT P50 ms none / drafts | "
            "gap P99 ms none / drafts | accepted | same tokens |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    verdict = True
    for kind in kinds:
        for s in streams:
            a, b = by[(kind, s, "none")], by[(kind, s, "drafts")]
            ratio = b["tokens_per_s"] / a["tokens_per_s"]
            verdict &= ratio >= (TARGET_QUOTE if kind == "quote" else FLOOR_CHAT)
            n_same, n = same[(kind, s)]
            lines.append(
                f"| {kind} | {s} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | {ratio:.2f} | "
                f"{a['tpot_p50_ms']:.1f} / {b['tpot_p50_ms']:.1f} | {a['gap_p99_ms']:.1f} / "
                f"{b['gap_p99_ms']:.1f} | {b['acceptance']:.0%} | {n_same} of {n} |"
            )
    lines += [
        "",
        (f"Pays (quote >= {TARGET_QUOTE}x, chat >= {FLOOR_CHAT}x at every stream count): {'yes' if verdict else 'no'}"),
        "",
        "Command: `python -m perf.bench.speculative_bench " + " ".join(sys.argv[1:] if argv is None else argv) + "`",
    ]
    report.write(out_dir, "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
