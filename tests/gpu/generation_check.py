"""`python -m tests.gpu.generation_check`: the generation engine on CUDA against transformers.

Needs torch with CUDA, transformers, safetensors and this repository's ``python_backends`` (no
tritonserver, no downloaded weights). A random-init ``LlamaForCausalLM`` of SmolLM2-135M's shape,
from a fixed seed, is saved and loaded into both the engine and ``transformers``; in each dtype:

a. greedy tokens of the engine (one prompt at a time, batched with a long prompt prefilled in
   chunks beside decodes, batched again on prefix-cache hits) against ``generate()`` one prompt at
   a time: the matching prefix, the prompts identical, the earliest divergence and the reference's
   logit gap there (a few ulps is a near tie, not a bug);
b. the max abs difference of the first step's logits (FP32, against transformers' last position);
c. tokens/s at 1 to 128 streams x 128 tokens against ``generate()`` one request at a time and as
   one left-padded static batch.

Prompts are seeded random ids (the engine decodes them with :class:`IdTokenizer`); EOS is unset,
so every stream runs its full length. Exit 1 when float32 parity fails (a token, or a logit by
more than ``FP32_LOGITS_TOL``); without CUDA it prints "skipped" and why and exits 0. ``--device
cpu --tiny``: the same on the CPU with a 2-layer model (tests/unit/test_gpu_generation_check.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from perf.lib import report

# First-step logits of a correct engine differ from transformers' by rounding only
# (about 1e-5 at logits of magnitude ~2 in FP32); a wrong RoPE, mask or weight is >1e-2.
FP32_LOGITS_TOL = 1e-3
# SmolLM2-135M's architecture (its config.json), with EOS/BOS unset. initializer_range: at
# transformers' default 0.02 greedy decoding of a random model this wide repeats one token (1-3
# distinct in 24), which cannot tell a broken attention from a working one; at 0.05 every prompt
# gave 24 distinct tokens in 24 (median top-2 logit gap 0.2 at logits of std 1.2). Norm weights
# are random too (build_checkpoint).
SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "initializer_range": 0.05,
}
# A 2-layer model of the same head layout for the CPU test: seconds, not minutes.
TINY = {
    **SMOLLM2_135M,
    "vocab_size": 2048,
    "hidden_size": 192,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "initializer_range": 0.1,
}

DTYPES = ("float32", "bfloat16", "float16")
PARITY_PROMPT_LENGTHS = (7, 16, 33, 61, 100, 150, 230, 400)
PARITY_NEW_TOKENS = 32
STREAMS = (1, 8, 32, 128)
THROUGHPUT_NEW_TOKENS = 128
THROUGHPUT_PROMPT_LENGTHS = (32, 96)  # uniform in [lo, hi]
SEED = 1234


class IdTokenizer:
    """Stand-in tokenizer for token-id prompts: the engine only decodes (id 17 -> " t17")."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" t{int(i)}" for i in ids)


def build_checkpoint(folder: str | Path, arch: dict = SMOLLM2_135M, seed: int = SEED) -> Path:
    """A random-init LlamaForCausalLM of ``arch`` saved (FP32 safetensors + config.json) in ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    config = LlamaConfig(**arch, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # RMSNorm weights start at 1; random ones make an engine that ignores them fail.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def make_prompts(lengths, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def load_hf(folder: Path, dtype: torch.dtype, device: torch.device):
    """transformers' model on the same weights, loaded the way a user would (dtype at load)."""
    from transformers import LlamaForCausalLM

    # PreTrainedModel.to is wrapped with functools.wraps(torch.nn.Module.to); typeshed's _Wrapped is
    # no descriptor, so mypy takes ``device`` for the unbound ``self``.
    return LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()  # type: ignore[arg-type]


def make_engine(folder: Path, device: torch.device, dtype: str, max_num_seqs: int = 128, num_blocks: int = 2048):
    """The engine as the served model builds it; 2,048 blocks of 16 hold 128 streams of 224 tokens."""
    from python_backends.generation.engine import LLMEngine
    from python_backends.generation.engine_config import EngineConfig

    cfg = EngineConfig(
        model_dir=folder,
        device=str(device),
        dtype=dtype,
        block_size=16,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=512,
        max_waiting=1024,
        max_model_len=1024,
        max_tokens_limit=512,
        enable_prefix_caching=True,
    )
    return LLMEngine(cfg, tokenizer=IdTokenizer())


def _greedy(n: int):
    from python_backends.generation.sampling import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_generate(model, prompts, new_tokens: int) -> list[list[int]]:
    """Greedy ``generate()`` of ``new_tokens`` over the prompts as one left-padded batch: the new ids per prompt."""
    dev = model.device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=dev)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p, device=dev)
        mask[r, width - len(p) :] = 1
    gen = model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    return gen[:, width:].tolist()


def hf_greedy_one_at_a_time(model, prompts, new_tokens: int) -> list[list[int]]:
    return [hf_generate(model, [p], new_tokens)[0] for p in prompts]


@torch.inference_mode()
def hf_last_logits(model, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens], device=model.device)
    return model(input_ids=ids).logits[0, -1].float()


def engine_greedy(engine, prompts, new_tokens: int, batched: bool) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
    """Greedy output ids per prompt, and each prompt's first sampled logits row as the engine computed it."""
    first: dict = {}
    runner = engine.runner
    execute = runner.execute

    def spy(plan):  # the engine's own forward; keeps the first logits row of each request
        logits = execute(plan)
        for row, chunk in enumerate(c for c in plan.chunks if c.samples):
            first.setdefault(chunk.seq_id, logits[row].clone())
        return logits

    runner.execute = spy
    rows: dict[int, torch.Tensor] = {}
    try:
        # engine.generate names its requests ("generate", <requests added before>, <index>).
        if batched:
            base = engine.counters["requests_added"]
            results = [ids for _, ids in engine.generate(prompts, _greedy(new_tokens))]
            rows = {i: first[("generate", base, i)] for i in range(len(prompts))}
        else:
            results = []
            for i, p in enumerate(prompts):
                base = engine.counters["requests_added"]
                results.append(engine.generate([p], _greedy(new_tokens))[0][1])
                rows[i] = first[("generate", base, 0)]
    finally:
        runner.execute = execute
    return results, rows


@dataclasses.dataclass
class Parity:
    """Engine tokens against the reference's, prompt by prompt."""

    mode: str
    matching_prefix: float  # tokens before each prompt's first divergence / all tokens
    prompts_identical: int
    num_prompts: int
    first_divergence: int | None  # earliest position where any prompt differs
    gap_at_divergence: float | None  # reference logit(ref token) - logit(engine token) there

    @property
    def identical(self) -> bool:
        return self.prompts_identical == self.num_prompts


def compare_tokens(mode: str, reference: list[list[int]], got: list[list[int]]) -> tuple[Parity, list[int | None]]:
    """Parity of ``got`` against ``reference``; also each prompt's first divergence (None: identical)."""
    if len(reference) != len(got):
        raise ValueError(f"{len(got)} results for {len(reference)} prompts")
    firsts: list[int | None] = []
    matched = total = 0
    for ref, out in zip(reference, got):
        n = min(len(ref), len(out))
        j = next((i for i in range(n) if ref[i] != out[i]), None)
        if j is None and len(ref) != len(out):
            j = n
        firsts.append(j)
        matched += len(ref) if j is None else j
        total += len(ref)
    diverged = [j for j in firsts if j is not None]
    parity = Parity(
        mode, matched / total if total else 1.0, firsts.count(None), len(reference), min(diverged) if diverged else None, None
    )
    return parity, firsts


def divergence_gap(model, prompts, reference, got, firsts) -> float | None:
    """At the earliest divergence: how far the reference preferred its token over the engine's."""
    candidates = [(j, i) for i, j in enumerate(firsts) if j is not None and j < len(got[i])]
    if not candidates:
        return None
    j, i = min(candidates)
    logits = hf_last_logits(model, prompts[i] + reference[i][:j])
    return float(logits[reference[i][j]] - logits[got[i][j]])


@dataclasses.dataclass
class DtypeResult:
    dtype: str
    parity: list[Parity]
    logits_max_abs_diff: float
    logits_max_abs: float
    hf_vs_hf_float32: float | None = None  # matching prefix of transformers' tokens vs its own FP32 tokens
    reference_distinct: float = 0.0  # distinct tokens / tokens per reference output, averaged
    throughput: list[dict] = dataclasses.field(default_factory=list)
    reference: list[list[int]] = dataclasses.field(default_factory=list, repr=False)

    def passed(self) -> bool:
        return all(p.identical for p in self.parity) and self.logits_max_abs_diff <= FP32_LOGITS_TOL


def check_parity(
    model_dir: Path,
    device: torch.device,
    dtype: str,
    prompts,
    new_tokens: int,
    engine_model_dir: Path | None = None,
    hf_model=None,
) -> DtypeResult:
    """(a) and (b) in one dtype. ``engine_model_dir`` (default ``model_dir``) lets a test feed the
    engine other weights than transformers, to see the check fail."""
    from python_backends.generation.model_runner import DTYPES as ENGINE_DTYPES

    torch_dtype = ENGINE_DTYPES[dtype]
    model = hf_model if hf_model is not None else load_hf(model_dir, torch_dtype, device)
    reference = hf_greedy_one_at_a_time(model, prompts, new_tokens)
    hf_logits = [hf_last_logits(model, p) for p in prompts]

    results = []
    engine = make_engine(engine_model_dir or model_dir, device, dtype)
    single, first_rows = engine_greedy(engine, prompts, new_tokens, batched=False)
    results.append(("engine one at a time", single))
    hits = engine.block_manager.prefix_hits
    hot, _ = engine_greedy(engine, prompts, new_tokens, batched=True)  # prompts' blocks cached now
    hits = engine.block_manager.prefix_hits - hits
    del engine
    engine = make_engine(engine_model_dir or model_dir, device, dtype)
    cold, cold_rows = engine_greedy(engine, prompts, new_tokens, batched=True)
    results.append(("engine batched", cold))
    results.append((f"engine batched, prefix hits ({hits} prompt tokens)", hot))
    del engine

    parities = []
    for mode, got in results:
        parity, firsts = compare_tokens(mode, reference, got)
        parity.gap_at_divergence = divergence_gap(model, prompts, reference, got, firsts)
        parities.append(parity)
    diffs, scale = [], 0.0
    for rows in (first_rows, cold_rows):
        for i, ref in enumerate(hf_logits):
            if i not in rows:
                raise RuntimeError(f"the engine sampled no first token for prompt {i}")
            diffs.append(float((rows[i].to(ref.device) - ref).abs().max()))
            scale = max(scale, float(ref.abs().max()))
    if hf_model is None:
        del model
    _free(device)
    distinct = sum(len(set(r)) / max(len(r), 1) for r in reference) / max(len(reference), 1)
    return DtypeResult(dtype, parities, max(diffs), scale, reference_distinct=distinct, reference=reference)


def hf_static_batch(model, prompts, new_tokens: int) -> int:
    """One left-padded generate() over all prompts; the tokens generated."""
    out = hf_generate(model, prompts, new_tokens)
    _sync(model.device)
    return sum(len(ids) for ids in out)


def measure_throughput(
    model_dir: Path,
    device: torch.device,
    dtype: str,
    streams=STREAMS,
    new_tokens: int = THROUGHPUT_NEW_TOKENS,
    serial_requests: int = 3,
    hf_model=None,
) -> list[dict]:
    """Tokens/s of the engine at each stream count, and of generate() serial and static-batched."""
    from python_backends.generation.model_runner import DTYPES as ENGINE_DTYPES

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(SEED + 1)
    lo, hi = THROUGHPUT_PROMPT_LENGTHS
    most = max(streams)
    lengths = torch.randint(lo, hi + 1, (most,), generator=gen).tolist()
    prompts = make_prompts(lengths, vocab, SEED + 2)
    model = hf_model if hf_model is not None else load_hf(model_dir, ENGINE_DTYPES[dtype], device)
    engine = make_engine(model_dir, device, dtype, max_num_seqs=max(most, 1))
    # Warm-up: CUDA context, cuBLAS handles, allocator pools, both systems.
    engine.generate(prompts[:2], _greedy(8))
    hf_static_batch(model, prompts[:2], 8)

    start = time.perf_counter()
    hf_serial = sum(hf_static_batch(model, [p], new_tokens) for p in prompts[:serial_requests]) / (time.perf_counter() - start)

    rows = []
    for n in streams:
        batch = prompts[:n]
        start = time.perf_counter()
        outs = engine.generate(batch, _greedy(new_tokens))
        _sync(device)
        eng_s = time.perf_counter() - start
        eng_tokens = sum(len(ids) for _, ids in outs)
        start = time.perf_counter()
        hf_tokens = hf_static_batch(model, batch, new_tokens)
        hf_s = time.perf_counter() - start
        rows.append({"streams": n, "engine_tok_s": eng_tokens / eng_s, "hf_static_batch_tok_s": hf_tokens / hf_s})
        rows[-1].update(hf_one_at_a_time_tok_s=hf_serial, engine_steps_s=eng_s)
    preemptions = engine.stats()["num_preemptions"]
    for r in rows:
        r["engine_preemptions"] = preemptions  # over all stream counts: 0 means the pool held every stream
    del engine
    if hf_model is None:
        del model
    _free(device)
    return rows


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fmt_gap(p: Parity) -> str:
    if p.first_divergence is None:
        return "-"
    gap = "" if p.gap_at_divergence is None else f" (gap {p.gap_at_divergence:.2e})"
    return f"{p.first_divergence}{gap}"


def format_report(results: list[DtypeResult]) -> str:
    """The markdown tables: token parity, first-step logits, tokens/s."""
    parity = [
        [r.dtype, p.mode, f"{100 * p.matching_prefix:.1f} %", f"{p.prompts_identical}/{p.num_prompts}", _fmt_gap(p)]
        for r in results
        for p in r.parity
    ]
    logits = [
        [r.dtype, f"{r.logits_max_abs_diff:.3e}", f"{r.logits_max_abs:.2f}"]
        + ["-" if r.hf_vs_hf_float32 is None else f"{100 * r.hf_vs_hf_float32:.1f} % matching prefix"]
        + [f"{100 * r.reference_distinct:.0f} %"]
        for r in results
    ]
    parts = [
        "## Greedy tokens: engine vs transformers generate() one prompt at a time",
        report.table(
            ["dtype", "engine mode", "matching prefix", "prompts identical", "first divergence (reference logit gap)"], parity, 2
        ),
        "## First-step logits (engine FP32 output vs transformers, cast to FP32)",
        report.table(
            [
                "dtype",
                "max abs diff",
                "max abs logit",
                "transformers vs its own float32 tokens",
                "distinct tokens per reference output",
            ],
            logits,
        ),
    ]
    if any(r.reference_distinct < 0.5 for r in results):
        parts.append(
            "WARNING: the reference repeats itself (under 50 % distinct tokens): the random model is too flat for token parity to test the attention"
        )
    speed = [
        [r.dtype, t["streams"], *(f"{t[k]:.0f}" for k in ("engine_tok_s", "hf_static_batch_tok_s", "hf_one_at_a_time_tok_s"))]
        + [f"{t['engine_tok_s'] / t[k]:.2f}" for k in ("hf_static_batch_tok_s", "hf_one_at_a_time_tok_s")]
        for r in results
        for t in r.throughput
    ]
    if speed:
        parts += [
            "## Tokens/s (new tokens per second of wall time, prefill included)",
            report.table(
                [
                    "dtype",
                    "streams",
                    "engine",
                    "generate() static batch",
                    "generate() one at a time",
                    "engine / static",
                    "engine / one at a time",
                ],
                speed,
            ),
        ]
    return "\n\n".join(parts)


def fp32_failures(results: list[DtypeResult]) -> list[str]:
    """Why float32 parity failed (empty: it passed or float32 was not run)."""
    out = []
    for r in results:
        if r.dtype != "float32":
            continue
        for p in r.parity:
            if not p.identical:
                out.append(
                    f"float32 {p.mode}: {p.num_prompts - p.prompts_identical} prompts differ, first at token {_fmt_gap(p)}"
                )
        if r.logits_max_abs_diff > FP32_LOGITS_TOL:
            out.append(f"float32 first-step logits differ by {r.logits_max_abs_diff:.3e} > {FP32_LOGITS_TOL}")
    return out


def run_checks(
    model_dir: Path,
    device: torch.device,
    dtypes=DTYPES,
    *,
    prompt_lengths=PARITY_PROMPT_LENGTHS,
    new_tokens: int = PARITY_NEW_TOKENS,
    streams=STREAMS,
    throughput_tokens: int = THROUGHPUT_NEW_TOKENS,
    throughput: bool = True,
    engine_model_dir: Path | None = None,
    log=print,
) -> list[DtypeResult]:
    """Parity (and throughput unless ``throughput`` is false) in each dtype on ``device``."""
    from python_backends.generation.model_runner import DTYPES as ENGINE_DTYPES

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(prompt_lengths, vocab, SEED)
    results: list[DtypeResult] = []
    fp32_reference = None
    for dtype in dtypes:
        t0 = time.perf_counter()
        model = load_hf(model_dir, ENGINE_DTYPES[dtype], device)
        res = check_parity(model_dir, device, dtype, prompts, new_tokens, engine_model_dir, hf_model=model)
        if dtype == "float32":
            fp32_reference = res.reference
        elif fp32_reference is not None:
            res.hf_vs_hf_float32 = compare_tokens("hf", fp32_reference, res.reference)[0].matching_prefix
        if throughput:
            res.throughput = measure_throughput(model_dir, device, dtype, streams, throughput_tokens, hf_model=model)
        del model
        _free(device)
        results.append(res)
        log(f"{dtype}: done in {time.perf_counter() - t0:.1f} s")
    return results


def environment(device: torch.device) -> dict:
    import transformers

    env: dict[str, object] = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device)}
    env["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.generation_check", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (with --tiny for a quick run)")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated subset of " + ", ".join(DTYPES))
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model of the same head layout (seconds)")
    ap.add_argument("--streams", default=",".join(map(str, STREAMS)), help="engine stream counts for tokens/s")
    ap.add_argument("--throughput-tokens", type=int, default=THROUGHPUT_NEW_TOKENS)
    ap.add_argument("--no-throughput", action="store_true", help="parity only")
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = ap.parse_args(argv)

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if bad := [d for d in dtypes if d not in DTYPES]:
        ap.error(f"unknown dtype {bad[0]!r}: choose from {', '.join(DTYPES)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        reason = "no CUDA device is visible (torch.cuda.is_available() is false)"
        print(
            f"skipped: {reason if torch.version.cuda else 'this PyTorch has no CUDA'}; the check needs an NVIDIA GPU (torch {torch.__version__})"
        )
        return 0
    # FP32 is compared as FP32: TF32 matmuls would round inputs to 10 mantissa bits.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    env = environment(device)
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    arch = TINY if args.tiny else SMOLLM2_135M
    with tempfile.TemporaryDirectory(prefix="gpu-generation-check-") as tmp:
        t0 = time.perf_counter()
        folder = build_checkpoint(Path(tmp) / "model", arch)
        print(
            f"random-init Llama ({arch['num_hidden_layers']} layers, hidden {arch['hidden_size']}, "
            f"vocab {arch['vocab_size']}) saved in {time.perf_counter() - t0:.1f} s"
        )
        streams = [int(s) for s in args.streams.split(",")]
        results = run_checks(
            folder, device, dtypes, streams=streams, throughput_tokens=args.throughput_tokens, throughput=not args.no_throughput
        )
    print("\n" + format_report(results) + "\n")
    failures = fp32_failures(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        found = [dict(dataclasses.asdict(r), reference=None) for r in results]
        args.out.write_text(json.dumps({"environment": env, "arch": arch, "fp32_failures": failures, "results": found}, indent=2))
    if failures:
        print("FAILED: float32 parity\n  " + "\n  ".join(failures))
        return 1
    print("float32 parity: passed" if "float32" in dtypes else "float32 not run: no parity verdict")
    return 0


if __name__ == "__main__":
    sys.exit(main())
