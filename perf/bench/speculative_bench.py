"""Prompt-lookup speculative decoding on and off, side by side: does it pay, and where.

Two in-process engines share one set of weights (``PRECISION``'s) and differ only in
``num_speculative_tokens``; requests alternate between them. **quote** prompts repeat their input
(the generation gate's held-out texts), **chat** prompts are perf/data/generation_prompts.json.
Per kind and ``--streams``: tokens/s, time per output token, output gaps (P99, max), steps per
token, drafts accepted, and outputs identical to those without drafts; then the ratios and the
verdict the engine's default rests on (docs/generation-internals.md#speculative-decoding).

    python -m perf.bench.speculative_bench [--precision auto] [--max-tokens 128] [--k 3] [--requests 8]
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perf.lib import options, report
from perf.lib.generation_systems import (
    DEFAULT_MODEL_DIR,
    engine_variant,
    resolve_precision,
    run_together,
    served_engine_settings,
    start_engine,
)
from perf.lib.paths import GENERATION_PROMPTS, ROOT
from perf.lib.stats import percentile_of

MODEL_DIR = DEFAULT_MODEL_DIR
HELDOUT = ROOT / "export" / "data" / "generation_heldout.json"
# What "pays" means here: quoting answers at least this much faster, ordinary ones no slower than this.
TARGET_QUOTE = 1.3
FLOOR_CHAT = 0.95


def prompts(tokenizer, n: int) -> dict[str, list[str]]:
    """The quote prompts and ``n`` chat prompts, the chat template applied."""

    def chat(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    code = "Add one comment line at the top of this code and return the whole code, otherwise unchanged:\n\n"
    copy = "Copy the following text exactly, word for word:\n\n"
    texts = json.loads(HELDOUT.read_text(encoding="utf-8"))["texts"]
    quote = [chat((code if t["name"] in ("python", "javascript") else copy) + t["text"]) for t in texts]
    entries = [e for e in json.loads(GENERATION_PROMPTS.read_text(encoding="utf-8"))["prompts"] if e["kind"] != "long"]
    return {"quote": quote, "chat": [chat(e["text"]) for e in entries[:: max(1, len(entries) // n)][:n]]}


def summarise(runs: Sequence[dict]) -> dict[str, Any]:
    """One engine's figures over its runs (perf.lib.generation_systems.run_together's)."""
    n_tokens = sum(len(t) for r in runs for t in r["tokens"])
    tpot, gaps = [], []
    for arr in (a for r in runs for a in r["arrivals"] if len(a) >= 2):
        tpot.append((arr[-1][0] - arr[0][0]) / sum(n for _, n in arr[1:]) * 1e3)
        gaps += [(b[0] - a[0]) * 1e3 for a, b in itertools.pairwise(arr)]
    drafted = sum(r["counters"]["spec_draft_tokens"] for r in runs)
    return {
        "tokens_per_s": n_tokens / sum(r["wall"] for r in runs),
        "tpot_p50_ms": percentile_of(tpot, 50),
        "gap_p99_ms": percentile_of(gaps, 99),
        "gap_max_ms": max(gaps, default=float("nan")),
        "steps_per_token": sum(r["counters"]["steps"] for r in runs) / max(1, n_tokens),
        "drafted": drafted,
        "acceptance": sum(r["counters"]["spec_accepted_tokens"] for r in runs) / drafted if drafted else 0.0,
        "tokens": n_tokens,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = options.parser("perf.bench.speculative_bench", __doc__)
    p.add_argument(
        "--precision", default=os.environ.get("PRECISION", "auto"), help="weights precision (default $PRECISION or auto)"
    )
    p.add_argument("--k", type=int, default=3, help="draft tokens per step (num_speculative_tokens, default 3)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--requests", type=int, default=8, help="requests per kind and stream count (default 8)")
    p.add_argument("--streams", default="1,2", help="concurrent requests per cell (default 1,2)")
    p.add_argument("--out-dir", type=Path, default=None, help="results folder (default perf/results/speculative-<UTC>)")
    args = p.parse_args(argv)
    from python_backends.generation.sampling import SamplingParams

    config_name, precision = resolve_precision(MODEL_DIR.parent.parent, args.precision)
    settings = served_engine_settings(MODEL_DIR.parent.parent, config_name)
    none = start_engine(
        {**settings, "num_blocks": 1024, "max_num_seqs": 8, "num_speculative_tokens": 0, "speculative_max_seqs": 2}
    )
    engines = {"none": none, "drafts": engine_variant(none, num_speculative_tokens=args.k)}
    out_dir = report.results_dir(args.out_dir, "speculative")
    kinds = prompts(none.tokenizer, args.requests)
    streams = [int(s) for s in args.streams.split(",")]
    load = report.load_average()
    print(f"perf.bench.speculative_bench: weights {precision}, k={args.k}, {args.max_tokens} new tokens, load average {load}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for e in engines.values():  # first-call allocations
        run_together(e, kinds["chat"][:1], SamplingParams(max_tokens=4, temperature=0.0), "warm")
    rows: list[dict[str, Any]] = []
    lines = []
    verdict = True
    for kind, chosen in kinds.items():
        chosen = (chosen * args.requests)[: args.requests]
        for s in streams:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
            for i in range(0, len(chosen), s):
                for name in list(engines) if (i // s) % 2 == 0 else list(reversed(engines)):
                    runs[name].append(run_together(engines[name], chosen[i : i + s], params, f"{kind}-{s}-{i}"))
            a, b = ({"kind": kind, "streams": s, "engine": name, **summarise(runs[name])} for name in engines)
            rows += [a, b]
            for r in (a, b):
                print(
                    f"  {kind:5} {s} stream(s) {r['engine']:6}: {r['tokens_per_s']:6.1f} tokens/s, TPOT P50 "
                    f"{r['tpot_p50_ms']:5.1f} ms, gap P99 {r['gap_p99_ms']:5.1f} max {r['gap_max_ms']:5.1f} ms, "
                    f"{r['steps_per_token']:.2f} steps/token, {r['acceptance']:.0%} of {r['drafted']} drafted accepted",
                    flush=True,
                )
            plain, drafted = ([t for run in runs[name] for t in run["tokens"]] for name in engines)
            ratio = b["tokens_per_s"] / a["tokens_per_s"]
            verdict &= ratio >= (TARGET_QUOTE if kind == "quote" else FLOOR_CHAT)
            lines.append(
                [kind, s, f"{a['tokens_per_s']:.1f}", f"{b['tokens_per_s']:.1f}", f"{ratio:.2f}"]
                + [f"{a[k]:.1f} / {b[k]:.1f}" for k in ("tpot_p50_ms", "gap_p99_ms")]
                + [f"{b['acceptance']:.0%}", f"{sum(x == y for x, y in zip(plain, drafted))} of {len(plain)}"]
            )
    columns = ["kind", "streams", "tokens/s none", "tokens/s drafts", "ratio", "TPOT P50 ms none / drafts"]
    summary = (
        f"# Prompt-lookup drafts on / off ({precision} weights, k={args.k}, {args.max_tokens} new tokens, load average {load})\n\n"
        + report.table([*columns, "gap P99 ms none / drafts", "accepted", "same tokens"], lines)
        + f"\n\nPays (quote >= {TARGET_QUOTE}x, chat >= {FLOOR_CHAT}x at every stream count): {'yes' if verdict else 'no'}\n\n"
        + "Command: `python -m perf.bench.speculative_bench "
        + " ".join(sys.argv[1:] if argv is None else argv)
        + "`\n"
    )
    report.write(out_dir, summary, csvs={"speculative.csv": rows}, say=print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
