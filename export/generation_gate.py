"""Precision variants of ``text_generation``: gated against the FP32 engine, then offered to the server.

A variant is the same exported safetensors multiplied in another precision
(``python_backends/generation/linear.py``: ``fp16_fp32``, ``bf16``, ``int4_bf16``); it is built when the model
loads, so what the export decides is whether each variant may be served on this CPU. For every
precision this CPU runs (:func:`~python_backends.generation.linear.runnable_precisions`), the
engine's own forward pass reads the held-out text (``export/data/generation_heldout.json``:
English, French, German, Spanish, Chinese, Python, JavaScript and a chat turn) with teacher
forcing, and each position's next-token distribution is compared with the FP32 engine's on the
same weights:

* ``top1_agreement``: positions whose most likely next token is FP32's;
* ``mean_kl``: KL(FP32 || variant) in nats, averaged over positions and texts;
* ``worst_text_kl``: the worst text's mean KL (one language must not carry the whole loss);
* ``ppl_ratio``: the variant's perplexity on the texts over FP32's.

Each variant is read twice: in prompt chunks of 256 tokens (the large-batch kernels) and in
chunks of ``INT4_MAX_ROWS`` tokens (the kernels of a decode step of a few streams); the worse
figure of the two counts. Limits are in export/gates.toml (``[text_generation.<variant>]``).

What passes gets ``configs/<variant>.pbtxt`` (config.pbtxt with ``weights_precision`` set); the
best that passed becomes ``configs/cpu.pbtxt``, what ``PRECISION=auto`` serves on a CPU. The
verdicts are recorded in ``text_generation/variants.json`` with the kernels' fingerprint (torch
version and the CPU flags that pick code paths) and the weights' hash: a checkout moved to
another CPU, or another torch, gates again at its next export instead of trusting these.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from export import variants as variant_files

log = logging.getLogger(__name__)

MODEL = "text_generation"
HELDOUT = Path(__file__).resolve().parent / "data" / "generation_heldout.json"
GATE_VERSION = 2  # bump when what the gate measures changes
# The order variants are listed and gated in. What PRECISION=auto serves is the fastest that passed,
# by a short decode probe on this CPU (choose_best); this order breaks ties.
BEST_FIRST = (
    "llama_q4_0",
    "llama_q4_1",
    "llama_q8_0",
    "ov_int4_f16",
    "ov_f16",
    "llama_bf16",
    "int4_bf16",
    "bf16",
    "fp16_fp32",
    "llama_f16",
    "fp32",
)
PROBE_STREAMS = (1, 16)  # the decode probe's concurrencies: one stream, and a loaded server
PROBE_ROUNDS = 2  # auto's candidates are probed this many times, interleaved; each keeps its best (choose_best)
AUTO_EXCLUDED = variant_files.LLAMA_VARIANTS  # see choose_best
DESCRIPTIONS = {
    "fp32": "FP32 weights: the reference, token for token transformers' numbers",
    "fp16_fp32": "FP16 weights through fbgemm's FP16 GEMM (AVX2), FP32 activations, products and K/V",
    "bf16": "BF16 weights and BF16 products (AVX512-BF16 / AMX), BF16 K/V",
    "int4_bf16": "4-bit blocks of 32 (the GGUF's Q4_1, exact) at up to 12 rows, BF16 above; BF16 output head and K/V",
    "llama_q4_0": "llama.cpp, Q4_0 from the FP32 export (4-bit blocks of 32, a scale each; head Q6_K; 8-bit activations), F16 K/V",
    "llama_q4_1": "llama.cpp, Q4_1 from the FP32 export (the packaged GGUF's blocks; head Q6_K; 8-bit activations), F16 K/V",
    "llama_q8_0": "llama.cpp, Q8_0 from the FP32 export (8-bit blocks of 32; 8-bit activations), F16 K/V",
    "llama_bf16": "llama.cpp, BF16 weights and products from the FP32 export, F16 K/V",
    "llama_f16": "llama.cpp, F16 weights and products from the FP32 export, F16 K/V",
    "ov_f16": "OpenVINO, GenAI's graph of the F16 GGUF, paged attention; BF16 products and K/V on AVX512-BF16 / AMX, else F32 / F16",
    "ov_int4_f16": "OpenVINO, ov_f16's graph with 4-bit blocks of 32 (Q4_1's, from the F16 weights) and an 8-bit head for steps of "
    "up to 2 tokens, ov_f16's graph above",
}
LARGE_CHUNK = 256


def heldout_texts(path: Path = HELDOUT) -> list[dict[str, str]]:
    return json.loads(path.read_text())["texts"]


def _runner(model_dir: Path, precision: str):
    from python_backends.generation.block_manager import BlockManager
    from python_backends.generation.llama_cpp_runtime import LLAMA_PRECISIONS, GGUFWeights, LlamaCppRunner
    from python_backends.generation.model_runner import LlamaWeights, ModelRunner
    from python_backends.generation.openvino_runtime import OV_BLOCK_SIZE, OV_PRECISIONS, OpenVINORunner, OVWeights

    if precision in LLAMA_PRECISIONS:
        return LlamaCppRunner(GGUFWeights.from_folder(model_dir, precision), BlockManager(64, 16), 1024, LARGE_CHUNK)
    if precision in OV_PRECISIONS:
        return OpenVINORunner(OVWeights.from_folder(model_dir, precision), 64, OV_BLOCK_SIZE, 1024)
    weights = LlamaWeights.from_folder(model_dir, precision=precision)
    return ModelRunner(weights, num_blocks=64, block_size=16, max_model_len=1024)


def _passes(runner, token_ids: list[list[int]], precision: str = "fp32") -> dict[int, list]:
    """Teacher-forced logits in chunks of LARGE_CHUNK and of the most rows a variant's 4-bit path runs,
    so a variant computed two ways is judged on both."""
    from python_backends.generation.linear import INT4_MAX_ROWS
    from python_backends.generation.openvino_runtime import OV_INT4_MAX_ROWS, OV_INT4_PRECISIONS

    small = OV_INT4_MAX_ROWS if precision in OV_INT4_PRECISIONS else INT4_MAX_ROWS
    return {chunk: [runner.sequence_logits(ids, chunk=chunk) for ids in token_ids] for chunk in (LARGE_CHUNK, small)}


def compare(reference: list, variant: list, token_ids: list[list[int]]) -> dict[str, float]:
    """The figures of one pass: lists of [len, vocab] FP32 logits, one per text."""
    import torch

    agree = positions = 0
    text_kl = []
    nll_ref = nll_var = 0.0
    for ref, var, ids in zip(reference, variant, token_ids):
        a, b = torch.log_softmax(ref, -1), torch.log_softmax(var, -1)
        kl = (a.exp() * (a - b)).sum(-1)
        text_kl.append(float(kl.mean()))
        agree += int((ref.argmax(-1) == var.argmax(-1)).sum())
        positions += len(ids)
        target = torch.tensor(ids[1:])[:, None]
        nll_ref -= float(a[:-1].gather(1, target).sum())
        nll_var -= float(b[:-1].gather(1, target).sum())
    predicted = positions - len(token_ids)
    return {
        "top1_agreement": agree / positions,
        "mean_kl": sum(text_kl) / len(text_kl),
        "worst_text_kl": max(text_kl),
        "ppl_ratio": float(torch.tensor((nll_var - nll_ref) / predicted).exp()),
        "positions": positions,
    }


def _worst(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {
        "top1_agreement": min(a["top1_agreement"], b["top1_agreement"]),
        "mean_kl": max(a["mean_kl"], b["mean_kl"]),
        "worst_text_kl": max(a["worst_text_kl"], b["worst_text_kl"]),
        "ppl_ratio": max(a["ppl_ratio"], b["ppl_ratio"]),
        "positions": a["positions"],
    }


def decode_speed(model_dir: Path, precision: str, batch: int, steps: int = 12) -> float:
    """Decode tokens/s of the in-process engine at ``batch`` streams (every prompt prefilled first)."""
    from python_backends.generation.engine import LLMEngine
    from python_backends.generation.engine_config import EngineConfig
    from python_backends.generation.sampling import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            weights_precision=precision,
            block_size=block_size(precision),
            num_blocks=batch * 8 + 8,
            max_num_seqs=batch,
            max_num_batched_tokens=max(256, batch),
        )
    )
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(i, f"Write a short story about the number {i}.", params)

    def first_token_pending(seq_id: int) -> bool:
        seq = engine.scheduler.get(seq_id)
        assert seq is not None, f"probe sequence {seq_id} left the scheduler before its first token"
        return not seq.output_tokens

    while any(first_token_pending(i) for i in range(batch)):
        engine.step()
    engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return batch * steps / (time.perf_counter() - started)


# The probe's process starts as the served model's stub does: python_backends.generation imported
# before torch (its OpenMP wait policy for torch's threads), one variant's runtime only. In the
# export's own process torch was loaded first by the other models' exports, with libgomp's spinning
# default: there int4_bf16 probed at 74 tokens/s and llama_bf16 at 43, served 34 and 74.
_PROBE_CHILD = """
import json, sys
from pathlib import Path

import python_backends.generation
from export.generation_gate import PROBE_STREAMS, decode_speed

print(json.dumps({b: decode_speed(Path(sys.argv[1]), sys.argv[2], b, steps=int(sys.argv[3])) for b in PROBE_STREAMS}))
"""


def probe_speeds(model_dir: Path, precision: str, steps: int = 24) -> dict[int, float]:
    """Decode tokens/s at each of PROBE_STREAMS, measured in a fresh process set up as the served stub."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE_CHILD, str(model_dir), precision, str(steps)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the probe's process exited with {done.returncode}: {done.stderr[-1500:]}")
    return {int(b): float(v) for b, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def gated_precisions() -> tuple[str, ...]:
    """What this CPU runs: PyTorch's precisions for its kernels, and llama.cpp's and OpenVINO's variants
    once llama.cpp is built (OpenVINO's models are made from its GGUFs)."""
    from export.llama_cpp import is_built
    from python_backends.generation.linear import runnable_precisions
    from python_backends.generation.llama_cpp_runtime import LLAMA_PRECISIONS
    from python_backends.generation.openvino_runtime import OV_PRECISIONS

    return runnable_precisions() + ((*LLAMA_PRECISIONS, *OV_PRECISIONS) if is_built() else ())


def block_size(precision: str, configured: int = 16) -> int:
    """The KV block size ``precision`` runs with: OpenVINO's CPU plugin keeps blocks of its own size."""
    from python_backends.generation.openvino_runtime import OV_BLOCK_SIZE, OV_PRECISIONS

    return OV_BLOCK_SIZE if precision in OV_PRECISIONS else configured


def choose_best(model_dir: Path, passed: list[str], rows: dict[str, dict[str, Any]], probe: bool = True) -> str | None:
    """The fastest variant that passed: decode tokens/s at each of PROBE_STREAMS, relative to the best
    at that concurrency, multiplied (so one stream and a loaded server count alike); recorded in each row.

    The candidates auto may choose are probed PROBE_ROUNDS times, in turn and in reversed order the
    second time, and each keeps its best figure per concurrency: a busy neighbour only ever slows a
    probe, and on a shared machine one 24-step probe of two close variants could reverse them.
    Without ``probe``, the first that passed in BEST_FIRST's order."""
    if len(passed) < 2:
        return passed[0] if passed else None
    if not probe:
        return next((p for p in BEST_FIRST if p in passed and p not in AUTO_EXCLUDED), None)
    speeds: dict[str, dict[int, float]] = {}
    failed: set[str] = set()
    candidates = [p for p in passed if p not in AUTO_EXCLUDED]
    rounds = [passed] + ([candidates[::-1]] if len(candidates) > 1 else []) * (PROBE_ROUNDS - 1)
    for order in rounds:
        for precision in (p for p in order if p not in failed):
            try:
                measured = probe_speeds(model_dir, precision)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run the probe is not chosen
                log.warning("%s/%s: decode probe failed: %s", MODEL, precision, exc)
                failed.add(precision)
                speeds.pop(precision, None)
                continue
            kept = speeds.setdefault(precision, measured)
            for b, v in measured.items():
                kept[b] = max(kept.get(b, 0.0), v)
            rows[precision]["probe_tokens_per_s"] = {str(b): round(v, 1) for b, v in kept.items()}
    # The probe's fresh engine flatters llama.cpp: its unified KV buffer attends over every cell up to
    # the highest one in use, and under sustained traffic the prefix cache's cells spread over the
    # whole pool (a 1 GiB pool, filled: prefill 200 tokens/s instead of 552, 16 streams 166 instead of
    # 329; llama_prefix_cells bounds the kept cells: 471 and 333 at 512). Until a sequence attends over
    # its own cells only, the llama_* variants are probed and recorded but served by name only
    # (PRECISION=llama_bf16), never chosen by auto.
    probed = ", ".join(f"{p} {'/'.join(f'{v:.0f}' for v in s.values())}" for p, s in speeds.items())
    speeds = {p: s for p, s in speeds.items() if p not in AUTO_EXCLUDED}
    if not speeds:
        return next((p for p in BEST_FIRST if p in passed and p not in AUTO_EXCLUDED), None)
    top = {b: max(s[b] for s in speeds.values()) for b in PROBE_STREAMS}

    def score(precision: str) -> float:
        out = 1.0
        for b in PROBE_STREAMS:
            out *= speeds[precision][b] / top[b]
        return out

    best = max(speeds, key=lambda p: (score(p), -BEST_FIRST.index(p)))
    log.info(
        "%s: decode probe (tokens/s at %s streams): %s; auto serves %s (llama_* by name only)",
        MODEL,
        "/".join(map(str, PROBE_STREAMS)),
        probed,
        best,
    )
    return best


def fingerprint() -> dict[str, str]:
    from openvino import get_version

    from python_backends.generation.linear import describe_cpu, kernel_fingerprint
    from python_backends.generation.llama_cpp_runtime import build_key

    kernels = f"{kernel_fingerprint()}; llama.cpp {build_key()}; openvino {get_version()}; {','.join(gated_precisions())}"
    return {"kernels": kernels, "cpu": describe_cpu(), "gate_version": str(GATE_VERSION)}


def up_to_date(repo: Path, weights_sha256: str) -> bool:
    """The recorded verdicts were made here: same kernels, same weights, same gate."""
    manifest = variant_files.read_manifest(repo, MODEL)
    fp = fingerprint()
    return (
        manifest.get("kernels") == fp["kernels"]
        and manifest.get("gate_version") == fp["gate_version"]
        and manifest.get("weights_sha256") == weights_sha256
        and bool(manifest.get("variants"))
    )


def gate_variants(repo: Path, weights_sha256: str, speed: bool = True, probe: bool = True) -> dict[str, Any]:
    """Gate every precision this CPU runs, write the manifest and the variant configs; return the manifest.
    ``probe`` False chooses auto's variant by BEST_FIRST's order instead of measuring (choose_best)."""
    from transformers import AutoTokenizer

    from export.llama_cpp import LlamaCppError, make_ggufs
    from export.openvino_ir import make_int4_ir, make_ir
    from python_backends.generation.llama_cpp_runtime import LLAMA_PRECISIONS, gguf_file
    from python_backends.generation.openvino_runtime import OV_INT4_PRECISIONS, OV_PRECISIONS, ir_dir

    model_dir = repo / MODEL / "1"
    precisions = tuple(sorted(gated_precisions(), key=BEST_FIRST.index))
    llama = [p for p in precisions if p in LLAMA_PRECISIONS]
    openvino = [p for p in precisions if p in OV_PRECISIONS]
    llama += [f"llama_{OV_PRECISIONS[p]}" for p in openvino if f"llama_{OV_PRECISIONS[p]}" not in llama]
    unbuilt: dict[str, str] = {}  # precision -> why its files could not be made
    if llama:  # made from these FP32 weights every time they are gated (15 s)
        try:
            make_ggufs(model_dir, llama)
        except LlamaCppError as exc:
            # e.g. a tokenizer llama.cpp's converter does not know: those variants fail, the others go on;
            # no GGUF of earlier weights is left for a runner to load
            reason = f"GGUF conversion: {_last_line(str(exc))}"
            log.warning("%s: %s", MODEL, reason)
            for precision in llama:
                (model_dir / gguf_file(precision)).unlink(missing_ok=True)
            unbuilt.update(dict.fromkeys([*llama, *openvino], reason))
    # GenAI's graph of each GGUF once (10 s), then the 4-bit graphs made from it (the gate below
    # reports a variant that could not be built as failed)
    builds = [(make_ir, p) for p in {ir_dir(model_dir, p): p for p in openvino if p not in unbuilt}.values()]
    for make, precision in builds + [(make_int4_ir, p) for p in openvino if p in OV_INT4_PRECISIONS and p not in unbuilt]:
        try:
            make(model_dir, precision)
        except Exception as exc:  # noqa: BLE001
            log.warning("%s/%s: %s", MODEL, precision, exc)
    gates = variant_files.load_gates().get(MODEL, {})
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    token_ids = [tokenizer.encode(t["text"]) for t in heldout_texts()]
    started = time.perf_counter()
    reference_runner = _runner(model_dir, "fp32")
    reference = _passes(reference_runner, token_ids)
    rows: dict[str, dict[str, Any]] = {}
    for precision in precisions:
        try:
            if precision in unbuilt:
                raise RuntimeError(unbuilt[precision])
            runner = reference_runner if precision == "fp32" else _runner(model_dir, precision)
            if precision == "fp32":
                metrics = {
                    "top1_agreement": 1.0,
                    "mean_kl": 0.0,
                    "worst_text_kl": 0.0,
                    "ppl_ratio": 1.0,
                    "positions": sum(map(len, token_ids)),
                }
            else:
                passes = _passes(runner, token_ids, precision)
                # the FP32 reference in the same chunks where it has them (ov_int4_f16's 2-token pass: its 256-token one)
                metrics = _worst(*(compare(reference.get(c, reference[LARGE_CHUNK]), passes[c], token_ids) for c in passes))
        except Exception as exc:  # noqa: BLE001 - a variant that cannot be built fails alone; FP32 serves
            if precision == "fp32":
                raise
            log.warning("%s/%s: cannot be built: %s", MODEL, precision, exc)
            rows[precision] = {
                "status": "failed",
                "metrics": {},
                "gate": gates.get(precision, {}),
                "failures": [f"build: {type(exc).__name__}: {exc}"],
                "description": DESCRIPTIONS[precision],
                "weights_mb": None,
            }
            continue
        limits = gates.get(precision, {})
        failures = variant_files.check_gate(metrics, limits)
        row = {
            "status": "passed" if not failures else "failed",
            "metrics": metrics,
            "gate": limits,
            "failures": failures,
            "description": DESCRIPTIONS[precision],
            "weights_mb": round(runner.weights.nbytes() / 2**20, 1),
        }
        del runner
        if speed:
            row["decode_tokens_per_s"] = {str(b): round(decode_speed(model_dir, precision, b), 1) for b in (1, 32)}
        log.info(
            "%s/%s: gate %s: top-1 agreement %.4f, mean KL %.5f (worst text %.5f), perplexity x%.4f, weights %.0f MiB%s%s",
            MODEL,
            precision,
            row["status"],
            metrics["top1_agreement"],
            metrics["mean_kl"],
            metrics["worst_text_kl"],
            metrics["ppl_ratio"],
            row["weights_mb"],
            f", decode tokens/s {row['decode_tokens_per_s']}" if speed else "",
            "" if not failures else ": " + "; ".join(failures),
        )
        rows[precision] = row
    passed = [p for p, r in rows.items() if r["status"] == "passed"]
    best = choose_best(model_dir, passed, rows, probe)
    manifest = {
        "model": MODEL,
        **fingerprint(),
        "weights_sha256": weights_sha256,
        "variants": rows,
        "best": {"cpu": best, "gpu": "fp32"},
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_configs(repo, passed, best)
    variant_files.write_manifest(repo, MODEL, manifest)
    return manifest


def _last_line(text: str) -> str:
    """The last non-empty line of a tool's output (a Python traceback's exception)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


_PRECISION_LINE = re.compile(r'^parameters \{ key: "weights_precision" value: \{ string_value: "[^"]*" \} \}$', re.M)


def _parameter_line(key: str) -> re.Pattern[str]:
    return re.compile(rf'^parameters \{{ key: "{key}" value: \{{ string_value: "([0-9]+)" \}} \}}$', re.M)


def variant_config(base: str, precision: str, header: str) -> str:
    """config.pbtxt's text serving ``precision``: its weights_precision parameter replaced, its
    block_size too for a runtime that keeps blocks of its own size, and no prompt-lookup drafts for
    ov_int4_f16 (a lone stream's step with drafts is 4 tokens: the F16 graph's, not the 4-bit one's;
    docs/generation-internals.md)."""
    from python_backends.generation.openvino_runtime import OV_INT4_PRECISIONS

    line = f'parameters {{ key: "weights_precision" value: {{ string_value: "{precision}" }} }}'
    text, n = _PRECISION_LINE.subn(line, base)
    if n != 1:
        raise ValueError(f"{MODEL}/config.pbtxt must have one weights_precision parameter line")
    overrides = {"block_size": lambda configured: block_size(precision, configured)}
    if precision in OV_INT4_PRECISIONS:
        overrides["num_speculative_tokens"] = lambda configured: 0
    for key, value in overrides.items():
        pattern = _parameter_line(key)
        found = pattern.search(text)
        if found is None:
            raise ValueError(f"{MODEL}/config.pbtxt must have one {key} parameter line")
        text = pattern.sub(f'parameters {{ key: "{key}" value: {{ string_value: "{value(int(found.group(1)))}" }} }}', text)
    return header + text


def write_configs(repo: Path, passed: list[str], best: str | None) -> None:
    """configs/<variant>.pbtxt for each variant that passed and configs/cpu.pbtxt (the best); the
    configs of variants that did not pass are removed, so they cannot be served."""
    folder = repo / MODEL / "configs"
    folder.mkdir(exist_ok=True)
    base = (repo / MODEL / "config.pbtxt").read_text()
    for precision in DESCRIPTIONS:
        target = folder / f"{precision}.pbtxt"
        if precision in passed:
            target.write_text(
                variant_config(
                    base,
                    precision,
                    (
                        f"# GENERATED by `python -m export` from ../config.pbtxt: weights_precision {precision} passed its gate\n"
                        f"# on this CPU (variants.json). Served with PRECISION={precision}.\n"
                    ),
                )
            )
        else:
            target.unlink(missing_ok=True)
    cpu = folder / "cpu.pbtxt"
    if best is None:
        cpu.unlink(missing_ok=True)
    else:
        cpu.write_text(
            variant_config(
                base,
                best,
                (
                    f"# GENERATED by `python -m export` from ../config.pbtxt: the best variant for this CPU that passed its\n"
                    f"# gate = {best} (variants.json). Served with PRECISION=auto or cpu.\n"
                ),
            )
        )


def markdown(manifest: dict[str, Any]) -> str:
    """The generation variants' rows of the export report."""
    lines = [
        f"Precision variants on this CPU ({manifest.get('cpu')}); `PRECISION=auto` serves "
        f"**{manifest.get('best', {}).get('cpu')}**. Gate: teacher-forced next-token distributions on the "
        f"held-out text against the FP32 engine (export/gates.toml).",
        "",
        "| variant | status | top-1 agreement | mean KL (nats) | worst text KL | perplexity ratio | weights MiB "
        "| decode tokens/s, 1 stream | 32 streams |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in manifest.get("variants", {}).items():
        m, speed = row["metrics"], row.get("decode_tokens_per_s", {})
        if not m:
            lines.append(f"| {name} | {row['status']}: {'; '.join(row.get('failures', []))} | | | | | | | |")
            continue
        lines.append(
            f"| {name} | {row['status']} | {m['top1_agreement']:.4f} | {m['mean_kl']:.5f} | "
            f"{m['worst_text_kl']:.5f} | {m['ppl_ratio']:.4f} | {row['weights_mb']} | {speed.get('1', '')} | "
            f"{speed.get('32', '')} |"
        )
    return "\n".join(lines) + "\n"
