"""Prompt log-probabilities (SamplingParams.prompt_logprobs) computed inside the engine's prefill.

On the FP32 PyTorch runtime they are transformers' own (log-softmax of its logits on the same
weights) within 1e-3 per token, whatever the prefill's chunking, with a prefix-cache entry for
the prompt already there (the request bypasses it), with n > 1 and beside running streams.
``max_tokens`` 0 returns the prompt's entries and no token. The OpenVINO and llama.cpp runtimes,
where exported, give the rows their own teacher-forced pass gives (the export gate's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from contract.errors import InputError
from python_backends.generation.engine import LLMEngine
from python_backends.generation.engine_config import EngineConfig
from python_backends.generation.sampling import SamplingParams

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "text_generation" / "1"
TEXT = (
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome. "
    "The capital of Portugal is Lisbon, and the capital of Spain"
)

pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").is_file(),
    reason="text_generation weights not exported (python -m export.generation)",
)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    return tok, model


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-probability of each prompt token after the first, ``[len - 1]``, and its logits."""
    _, model = hf
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def run(engine: LLMEngine, requests) -> dict:
    """Each request's outputs, stepping until all finish."""
    outs: dict = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def prompt_entries(outputs) -> dict[int, list]:
    """choice index -> its prompt entries (from its first output only)."""
    got: dict[int, list] = {}
    for out in outputs:
        if out.prompt_logprobs is not None:
            assert out.index not in got, "prompt entries come once per choice"
            got[out.index] = out.prompt_logprobs
    return got


@pytest.mark.parametrize("budget", [256, 16], ids=["one-chunk", "chunks-of-16"])
def test_prompt_logprobs_are_transformers_own_through_cache_chunks_and_choices(hf, budget):
    tok, _ = hf
    engine = LLMEngine(
        EngineConfig(model_dir=MODEL_DIR, num_blocks=128, block_size=16, max_num_seqs=8, max_num_batched_tokens=budget),
        tokenizer=tok,
    )
    ids = engine.encode(TEXT)
    assert len(ids) > 2 * 16
    logp = reference(hf, ids)
    # The prompt's blocks are in the prefix cache first; a running stream shares the steps.
    run(engine, [("warm", TEXT, SamplingParams(max_tokens=2, temperature=0.0))])
    engine.add_request("beside", "Once upon a time", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    outs = run(engine, [("ask", TEXT, SamplingParams(max_tokens=3, temperature=0.0, n=2, prompt_logprobs=2, logprobs=0))])
    assert all(o.num_cached_tokens == 0 for o in outs["ask"]), "the request computed its whole prompt"
    by_choice = prompt_entries(outs["ask"])
    assert set(by_choice) == {0, 1}
    diffs = []
    for entries in by_choice.values():
        assert len(entries) == len(ids) and entries[0] is None
        for pos, entry in enumerate(entries[1:], 1):
            assert entry.token_id == ids[pos]
            diffs.append(abs(entry.logprob - float(logp[pos - 1, ids[pos]])))
            top = logp[pos - 1].topk(2)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert max(abs(v - float(w)) for (_, v), w in zip(entry.top, top.values)) < 1e-3
    assert max(diffs) < 1e-3, f"max |engine - transformers| {max(diffs):.2e}"
    # The generated tokens are unchanged by the rows the prompt returned.
    answers = {o.index: o for o in outs["ask"] if o.finished}
    assert all(o.finish_reason == "length" and o.num_output_tokens == 3 for o in answers.values())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_max_tokens_zero_returns_the_prompt_alone(hf):
    tok, _ = hf
    engine = LLMEngine(EngineConfig(model_dir=MODEL_DIR, num_blocks=64, block_size=16), tokenizer=tok)
    ids = engine.encode(TEXT)
    (out,) = run(engine, [("zero", ids, SamplingParams(max_tokens=0, prompt_logprobs=0, logprobs=1))])["zero"]
    assert out.finished and out.finish_reason == "length"
    assert (out.text, out.token_ids, out.num_output_tokens, out.num_input_tokens) == ("", [], 0, len(ids))
    assert out.logprobs == [] and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[1].top == ()
    with pytest.raises(InputError, match="max_tokens: must be > 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InputError, match="prompt_logprobs: must be between 0 and 20"):
        SamplingParams(prompt_logprobs=21)


def _exported(precision: str) -> bool:
    from python_backends.generation.llama_cpp_runtime import LLAMA_PRECISIONS, gguf_file
    from python_backends.generation.openvino_runtime import IR_FILE, ir_dir

    if precision in LLAMA_PRECISIONS:
        from export.llama_cpp import is_built

        return is_built() and (MODEL_DIR / gguf_file(precision)).is_file()
    return (ir_dir(MODEL_DIR, precision) / IR_FILE).is_file()


@pytest.mark.parametrize("precision", ["ov_f16", "llama_f16"])
def test_other_runtimes_return_their_teacher_forced_rows(precision):
    if not _exported(precision):
        pytest.skip(f"text_generation's {precision} variant is not exported (python -m export)")
    from python_backends.generation.openvino_runtime import OV_BLOCK_SIZE

    engine = LLMEngine(
        EngineConfig(
            model_dir=MODEL_DIR,
            weights_precision=precision,
            block_size=OV_BLOCK_SIZE if precision.startswith("ov_") else 16,
            num_blocks=64,
            max_num_seqs=16,
            max_num_batched_tokens=256,
            num_threads=2,
        )
    )
    ids = engine.encode(TEXT)
    (out,) = run(engine, [("p", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))])["p"]
    logp = torch.log_softmax(engine.runner.sequence_logits(ids, chunk=16).float(), -1)
    diffs = [abs(e.logprob - float(logp[pos - 1, ids[pos]])) for pos, e in enumerate(out.prompt_logprobs[1:], 1)]
    assert max(diffs) < 1e-2, f"{precision}: max |served - teacher forced| {max(diffs):.2e}"
