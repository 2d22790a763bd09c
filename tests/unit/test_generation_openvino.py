"""The engine on OpenVINO (python_backends/generation/openvino_runtime.py): OpenVINO GenAI's graph of
the exported F16 GGUF (export/openvino_ir.py), run in its paged form over the block manager's tables.

The runner replaces only the forward pass, so the engine's features are checked through it: the
numbers against the FP32 engine, prefix-cache hits, forks of n choices and their copies on write,
preemption, speculative drafts, cancellation, guides, logprobs and penalties."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from contract.errors import ConfigError
from export import generation_gate, variants
from python_backends.generation.engine import LLMEngine
from python_backends.generation.engine_config import EngineConfig
from python_backends.generation.linear import int4_blocks
from python_backends.generation.openvino_runtime import (
    IR_FILE,
    OV_BLOCK_SIZE,
    OV_INT4_MAX_ROWS,
    OV_PRECISIONS,
    int4_codes,
    int4_values,
    int8_codes,
    ir_dir,
)
from python_backends.generation.sampling import SamplingParams
from tests.unit.runtime_checks import PROMPTS, SYSTEM, continue_after_each_cut, margins, run_all, same_until_a_near_tie

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "text_generation" / "1"
PRECISION = "ov_f16"

pytestmark = pytest.mark.skipif(
    not (ir_dir(MODEL_DIR, PRECISION) / IR_FILE).is_file(),
    reason="text_generation's OpenVINO model is not exported (python -m export, with llama.cpp built for its GGUF)",
)


def _engine(**overrides) -> LLMEngine:
    settings = dict(
        model_dir=MODEL_DIR,
        weights_precision=PRECISION,
        block_size=OV_BLOCK_SIZE,
        num_blocks=128,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_threads=2,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return _engine()


def test_teacher_forced_logits_are_the_fp32_engines():
    from python_backends.generation.model_runner import LlamaWeights, ModelRunner

    engine = _engine()
    ids = engine.encode("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is")
    reference = ModelRunner(LlamaWeights.from_folder(MODEL_DIR), 64, 16, 1024).sequence_logits(ids)
    for chunk in (256, 7):  # one inference, and decode-sized pieces over the paged cache
        got = engine.runner.sequence_logits(ids, chunk=chunk)
        a, b = torch.log_softmax(reference, -1), torch.log_softmax(got, -1)
        kl = (a.exp() * (a - b)).sum(-1)
        assert float(kl.mean()) < 3e-3 and (reference.argmax(-1) == got.argmax(-1)).float().mean() >= 0.95


def test_greedy_answers_alone_equal_batched_and_after_prefix_hits(engine):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [SYSTEM + p for p in PROMPTS]
    alone, lp = {}, {}
    solo = _engine(enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        one_lp: dict = {}
        one = run_all(solo, [p], params, f"solo{i}-", one_lp)
        alone[f"{i}/0"], lp[f"{i}/0"] = one["0/0"], one_lp["0/0"]
    hits_before = engine.stats()["prefix_cache_hits"]
    batched = run_all(engine, prompts, params, "a")
    again = run_all(engine, prompts, params, "b")
    assert engine.stats()["prefix_cache_hits"] - hits_before >= 6  # the system prompt's blocks, shared
    same_until_a_near_tie(alone, margins(lp), batched)
    same_until_a_near_tie(alone, margins(lp), again)


def test_n_choices_share_the_prompt_and_greedy_choices_equal_one(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    lp: dict = {}
    one = run_all(engine, [SYSTEM + PROMPTS[4]], greedy, "one", lp)
    forked = engine.stats().get("sequences_forked", 0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=3)
    many = run_all(engine, [SYSTEM + PROMPTS[4]], params, "many")
    assert engine.stats()["sequences_forked"] == forked + 2
    for i in range(3):  # each fork's copy of the prompt's partial block gives the same answer
        same_until_a_near_tie(one, margins(lp), {"0/0": many[f"0/{i}"]})
    sampled = run_all(engine, [PROMPTS[4]], SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3, ignore_eos=True), "s")
    assert len({tuple(v) for v in sampled.values()}) > 1


def test_preemption_under_a_small_pool_finishes_every_stream():
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    lp: dict = {}
    expected = run_all(_engine(), PROMPTS, params, "big", lp)
    small = _engine(num_blocks=8)
    got = run_all(small, PROMPTS, params, "big")
    assert small.stats()["num_preemptions"] > 0
    same_until_a_near_tie(expected, margins(lp), got)
    assert small.block_manager.num_used_blocks == 0


def test_speculative_drafts_give_the_tokens_of_plain_decoding():
    text = "Repeat exactly: alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta"
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=2)
    lp: dict = {}
    plain = run_all(_engine(), [text], params, "p", lp)
    drafting = _engine(num_speculative_tokens=3)
    drafted = run_all(drafting, [text], params, "p")
    assert drafting.stats()["spec_accepted_tokens"] > 0
    same_until_a_near_tie(plain, margins(lp), drafted)


def test_abort_frees_the_blocks_at_once(engine):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"x{i}", p, params)
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    for i in range(len(PROMPTS)):
        engine.abort(f"x{i}")
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()


def test_guides_logprobs_and_penalties_run_on_the_openvino_logits(engine):
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
    assert len(set(tokens)) >= len(tokens) - 3


def test_a_block_size_other_than_the_plugins_is_refused_by_name():
    with pytest.raises(ConfigError, match=f"block_size must be {OV_BLOCK_SIZE}"):
        _engine(block_size=16)


def test_every_variant_is_named_by_its_runtime_and_its_config_takes_the_plugins_block_size():
    assert all(p.startswith("ov_") for p in OV_PRECISIONS)
    assert set(OV_PRECISIONS) == set(variants.OV_VARIANTS) and set(OV_PRECISIONS) <= set(variants.GENERATION_VARIANTS)
    base = (MODEL_DIR.parent / "config.pbtxt").read_text()
    text = generation_gate.variant_config(base, PRECISION, "")
    assert f'key: "block_size" value: {{ string_value: "{OV_BLOCK_SIZE}" }}' in text
    assert f'key: "weights_precision" value: {{ string_value: "{PRECISION}" }}' in text
    assert 'key: "num_speculative_tokens" value: { string_value: "3" }' in text
    # ov_int4_f16 without drafts: a lone stream's step stays on its 4-bit graph
    text = generation_gate.variant_config(base, "ov_int4_f16", "")
    assert 'key: "num_speculative_tokens" value: { string_value: "0" }' in text
    assert f'key: "block_size" value: {{ string_value: "{OV_BLOCK_SIZE}" }}' in text


def _kl(reference: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    a, b = torch.log_softmax(reference, -1), torch.log_softmax(got, -1)
    return (a.exp() * (a - b)).sum(-1)


def test_int4_codes_decode_to_q4_1s_values_and_a_flat_block_keeps_its_value():
    torch.manual_seed(0)
    weight = torch.randn(8, 64)
    weight[3, :32] = 0.25  # a block of equal weights: Q4_1's scale is 0
    weight[4, 32:] = -1.5
    weight[5, :32] = 0.0
    q, scale, minimum = int4_blocks(weight)
    expected = (q.reshape(8, 2, 32).float() * scale[..., None] + minimum[..., None]).reshape(8, 64)
    codes, s16, zero_point = int4_codes(weight.numpy())
    assert codes.dtype == np.uint8 and codes.max() <= 15 and codes.shape == (8, 2, 32)
    got = torch.from_numpy(int4_values(codes, s16, zero_point))
    # OpenVINO's scale and zero point are F16: within F16's rounding of Q4_1's values
    assert torch.allclose(got, expected, rtol=2e-3, atol=2e-3)
    assert torch.equal(got[3, :32], torch.full((32,), 0.25)) and torch.equal(got[4, 32:], torch.full((32,), -1.5))
    assert torch.equal(got[5, :32], torch.zeros(32))
    head, head_scale = int8_codes(weight.numpy())
    decoded = head.astype(np.float32) * head_scale.astype(np.float32)
    assert np.abs(decoded.reshape(8, 64) - weight.numpy()).max() <= np.abs(weight.numpy()).max() / 127


@pytest.fixture(scope="module")
def int4_engine() -> LLMEngine:
    return _engine(weights_precision="ov_int4_f16")


def test_int4_variant_runs_small_steps_on_its_codes_and_both_paths_match_the_fp32_engine(int4_engine):
    from python_backends.generation.model_runner import LlamaWeights, ModelRunner

    runner = int4_engine.runner
    ids = int4_engine.encode("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is")
    ids = ids[: len(ids) // 6 * 6]  # the last chunk as long as the others, so it takes the same path
    reference = ModelRunner(LlamaWeights.from_folder(MODEL_DIR), 64, 16, 1024).sequence_logits(ids)
    by_path = {}
    for chunk, small in ((256, False), (OV_INT4_MAX_ROWS, True), (OV_INT4_MAX_ROWS + 1, False)):
        got = runner.sequence_logits(ids, chunk=chunk)
        assert (runner._last is runner._small) is small, chunk  # the step's size picks the graph
        assert float(_kl(reference, got).mean()) < 3e-3 and (reference.argmax(-1) == got.argmax(-1)).float().mean() >= 0.95
        by_path[small] = got
    # one model computed two ways (BF16 products of the F16 values, or the codes decoded per block): the
    # paths agree with each other within the gate's bar too
    between = _kl(by_path[False], by_path[True])
    assert float(between.mean()) < 3e-3 and (by_path[False].argmax(-1) == by_path[True].argmax(-1)).float().mean() >= 0.95


def test_int4_variant_greedy_tokens_are_fp32s_choices_on_either_path(int4_engine):
    # One stream decodes on the 4-bit graph, four on the F16 one, over K/V either wrote: the two paths
    # may part where FP32's two best tokens are close, so each greedy token is checked against FP32's
    # teacher-forced distribution at its own position: its argmax, or within 0.5 nats of it.
    from python_backends.generation.model_runner import LlamaWeights, ModelRunner

    reference = ModelRunner(LlamaWeights.from_folder(MODEL_DIR), 64, 16, 1024)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [SYSTEM + p for p in PROMPTS[:4]]
    alone = {}
    for i, p in enumerate(prompts):
        alone[f"{i}/0"] = run_all(int4_engine, [p], params, f"int4-solo{i}-")["0/0"]
    assert int4_engine.runner._last is int4_engine.runner._small  # a lone stream's decode: the codes
    batched = run_all(int4_engine, prompts, params, "int4-b")
    assert int4_engine.runner._last is not int4_engine.runner._small
    for answers in (alone, batched):
        for key, tokens in answers.items():
            prompt = int4_engine.encode(prompts[int(key.split("/")[0])])
            logp = torch.log_softmax(reference.sequence_logits(prompt + tokens), -1)[len(prompt) - 1 : -1]
            chosen = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            assert bool((logp.max(-1).values - chosen <= 0.5).all()), (key, tokens)
    assert int4_engine.block_manager.num_used_blocks == 0


def test_a_stream_continued_after_its_first_pieces_gives_the_uninterrupted_tokens(engine):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    continue_after_each_cut(engine, SYSTEM + PROMPTS[4], params)


def test_the_int4_variant_continues_a_lone_stream_token_for_token(int4_engine):
    """ov_int4_f16 (what PRECISION=auto serves on this kind of CPU) decodes on its 4-bit weights and
    prefills on F16 ones, so a continued stream's given tokens get their K/V one per step (replay_rows),
    as the decodes that made them: greedy and seeded continuations are then the lone stream's own."""
    assert int4_engine.scheduler.replay_rows == 1
    prompt = int4_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a walk along the sea in a few sentences."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    for params in (
        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True),
    ):
        whole = run_all(int4_engine, [prompt], params, "whole")["0/0"]
        for cut in (1, 9):
            int4_engine.add_request("rest", prompt, params, prefix_ids=whole[:cut])
            rest = []
            while int4_engine.has_unfinished():
                rest += [t for o in int4_engine.step() for t in o.token_ids]
            assert whole[:cut] + rest == whole, (params, cut)
