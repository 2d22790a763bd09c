"""The engine on llama.cpp (python_backends/generation/llama_cpp_runtime.py): the real library built for
this CPU (export/llama_cpp.py, scripts/setup.sh) and the GGUF files the export makes from the FP32 weights.

The runner replaces only the forward pass, so the engine's features are checked through it: the
numbers against the FP32 engine, prefix-cache hits, forks of n choices, preemption, speculative
drafts, cancellation and the mirror of the block manager in llama.cpp's sequence ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from contract.errors import ConfigError
from export import variants
from python_backends.generation.engine import LLMEngine
from python_backends.generation.engine_config import EngineConfig
from python_backends.generation.llama_cpp_runtime import LLAMA_PRECISIONS, gguf_file
from python_backends.generation.sampling import SamplingParams
from tests.unit.runtime_checks import PROMPTS, SYSTEM, continue_after_each_cut, margins, run_all, same_until_a_near_tie

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "text_generation" / "1"
PRECISION = "llama_f16"  # the variant closest to FP32 (the gate's figures: KL 1e-5)


def _built() -> bool:
    from export.llama_cpp import is_built

    return is_built() and (MODEL_DIR / gguf_file(PRECISION)).is_file()


pytestmark = pytest.mark.skipif(not _built(), reason="llama.cpp not built or text_generation not exported (python -m export)")


def _engine(**overrides) -> LLMEngine:
    settings = dict(
        model_dir=MODEL_DIR,
        weights_precision=PRECISION,
        num_blocks=256,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_threads=2,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return _engine()


def _check_mirror(engine: LLMEngine) -> None:
    """Every retired llama.cpp id owns blocks the prefix cache still holds, and owns them alone."""
    runner = engine.runner
    for ls in runner._retired.values():
        assert ls.owned, ls
        for block in ls.owned:
            assert engine.block_manager.is_cached(block) and runner._owner[block][0] is ls
    assert not runner._running or engine.has_unfinished()


def test_teacher_forced_logits_are_the_fp32_engines():
    from python_backends.generation.model_runner import LlamaWeights, ModelRunner

    engine = _engine()
    ids = engine.encode("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is")
    reference = ModelRunner(LlamaWeights.from_folder(MODEL_DIR), 64, 16, 1024).sequence_logits(ids)
    for chunk in (256, 7):  # one batch, and decode-sized pieces
        got = engine.runner.sequence_logits(ids, chunk=chunk)
        a, b = torch.log_softmax(reference, -1), torch.log_softmax(got, -1)
        kl = (a.exp() * (a - b)).sum(-1)
        assert float(kl.max()) < 1e-3 and (reference.argmax(-1) == got.argmax(-1)).float().mean() >= 0.95


def test_greedy_answers_alone_equal_batched_and_after_prefix_hits(engine):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [SYSTEM + p for p in PROMPTS]
    alone, lp = {}, {}
    for i, p in enumerate(prompts):
        one, one_lp = {}, {}
        one = run_all(_engine(enable_prefix_caching=False), [p], params, "solo", one_lp)
        alone[f"{i}/0"], lp[f"{i}/0"] = one["0/0"], one_lp["0/0"]
    hits_before = engine.stats()["prefix_cache_hits"]
    batched = run_all(engine, prompts, params, "a")
    again = run_all(engine, prompts, params, "b")
    assert engine.stats()["prefix_cache_hits"] - hits_before >= 6 * 32  # the system prompt's blocks, shared
    same_until_a_near_tie(alone, margins(lp), batched)
    same_until_a_near_tie(alone, margins(lp), again)
    _check_mirror(engine)


def test_finished_sequences_keep_at_most_the_prefix_cell_budget_oldest_first():
    small = _engine(llama_prefix_cells=64)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    bs = small.block_manager.block_size
    prompts = [f"Request {k}. {p} {p} {p}" for k, p in enumerate(PROMPTS)]  # two or three full blocks each
    for k, prompt in enumerate(prompts):
        run_all(small, [prompt], params, f"k{k}")
        runner = small.runner
        kept = sum(len(ls.owned) for ls in runner._retired.values()) * bs
        assert 0 < kept <= 64, kept
        _check_mirror(small)
    # The newest finished prompt is still a prefix hit; the first one's blocks were given up.
    hits = small.stats()["prefix_cache_hits"]
    run_all(small, [prompts[-1]], params, "again")
    assert small.stats()["prefix_cache_hits"] > hits
    with pytest.raises(ConfigError, match="llama_prefix_cells"):
        _engine(llama_prefix_cells=-1)


def test_n_choices_share_the_prompt_and_greedy_choices_equal_one(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    lp = {}
    one = run_all(engine, [SYSTEM + PROMPTS[4]], greedy, "one", lp)
    forked = engine.stats().get("sequences_forked", 0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=3)
    many = run_all(engine, [SYSTEM + PROMPTS[4]], params, "many")
    assert engine.stats()["sequences_forked"] == forked + 2
    for i in range(3):
        same_until_a_near_tie(one, margins(lp), {"0/0": many[f"0/{i}"]})
    sampled = run_all(engine, [PROMPTS[4]], SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3, ignore_eos=True), "s")
    assert len({tuple(v) for v in sampled.values()}) > 1  # seeds 7, 8, 9: different draws
    _check_mirror(engine)


def test_preemption_under_a_small_pool_finishes_every_stream(engine):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    lp = {}
    expected = run_all(_engine(), PROMPTS, params, "big", lp)
    small = _engine(num_blocks=14)
    got = run_all(small, PROMPTS, params, "big")
    assert small.stats()["num_preemptions"] > 0
    same_until_a_near_tie(expected, margins(lp), got)
    _check_mirror(small)
    assert small.block_manager.num_used_blocks == 0


def test_speculative_drafts_give_the_tokens_of_plain_decoding():
    text = "Repeat exactly: alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta"
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=2)
    lp = {}
    plain = run_all(_engine(), [text], params, "p", lp)
    drafting = _engine(num_speculative_tokens=3)
    drafted = run_all(drafting, [text], params, "p")
    assert drafting.stats()["spec_accepted_tokens"] > 0
    same_until_a_near_tie(plain, margins(lp), drafted)


def test_abort_frees_the_blocks_and_the_llama_ids_at_once(engine):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"x{i}", p, params)
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0 and engine.runner._running
    for i in range(len(PROMPTS)):
        engine.abort(f"x{i}")
    assert engine.block_manager.num_used_blocks == 0 and not engine.runner._running
    _check_mirror(engine)


def test_guides_logprobs_and_penalties_run_on_the_llama_logits(engine):
    params = SamplingParams(max_tokens=8, temperature=0.0, guided_choice=["red", "blue", "green"], logprobs=2)
    engine.add_request("g", "My favourite colour is", params)
    text, logprobs = "", []
    while engine.has_unfinished():
        for o in engine.step():
            text += o.text
            logprobs += o.logprobs or []
    assert text in ("red", "blue", "green") and logprobs
    penalised = run_all(engine, [PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=2.0), "f")
    tokens = penalised["0/0"]
    assert len(set(tokens)) >= len(tokens) - 3  # hardly a token twice


def test_every_variant_is_named_by_its_runtime_and_file_type():
    assert all(p.startswith("llama_") for p in LLAMA_PRECISIONS)
    assert {gguf_file(p) for p in LLAMA_PRECISIONS} == {f"model-{t.lower()}.gguf" for t in LLAMA_PRECISIONS.values()}
    # The launcher's list (export/variants.py, which does not import torch) names them all.
    assert set(LLAMA_PRECISIONS) <= set(variants.GENERATION_VARIANTS)


def test_a_stream_continued_after_its_first_pieces_gives_the_uninterrupted_tokens(engine):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    continue_after_each_cut(engine, SYSTEM + PROMPTS[4], params)
