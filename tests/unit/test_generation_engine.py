"""The engine against transformers' generate() on the exported SmolLM2 weights (FP32, CPU).

Greedy tokens must be identical, token for token: one request at a time, 16 at once with
mixed lengths, with prefix-cache hits, with chunked prefill, and after preemption.
Seeded sampling gives the same tokens alone and batched. Cancellation and failures free
every block.
"""

from __future__ import annotations

import functools
import math
import random
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from contract.errors import ConfigError, InputError
from python_backends.generation.engine import LLMEngine
from python_backends.generation.engine_config import EngineConfig
from python_backends.generation.engine_loop import EngineLoop
from python_backends.generation.model_runner import LlamaWeights
from python_backends.generation.sampling import SamplingParams
from python_backends.generation.scheduler import ContextTooLong, QueueFull

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "text_generation" / "1"
NEW_TOKENS = 24

pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").is_file(),
    reason="text_generation weights not exported (python -m export.generation)",
)

MESSAGES = [
    "What is the capital of France? Answer in one sentence.",
    "Écris une phrase sur la mer.",
    "Wie spät ist es in Tokio, wenn es in Berlin Mittag ist?",
    "用一句话介绍长城。",
    "Write a Python function that reverses a string.",
    "def fibonacci(n):",
    "List three primary colours.",
]


def long_prompt(tokenizer) -> str:
    """A prompt of about 1,500 tokens: a chat turn around a long passage."""
    rng = random.Random(7)
    words = (
        "the model serves many clients at once while each stream gets its tokens in time "
        "and the cache keeps every block of keys and values until the sequence ends"
    ).split()
    passage = " ".join(rng.choice(words) for _ in range(1400))
    text = chat(tokenizer, f"Summarise this passage in one sentence:\n{passage}")
    n = len(tokenizer.encode(text, add_special_tokens=False))
    assert 1300 <= n <= 1700, n
    return text


def chat(tokenizer, message: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def prompts(hf):
    tok, _ = hf
    return [chat(tok, m) for m in MESSAGES] + [long_prompt(tok)]


@pytest.fixture(scope="module")
def reference(hf, prompts):
    """transformers generate(), greedy, one prompt at a time, without the engine."""
    tok, model = hf
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


@functools.cache
def fp32_weights() -> LlamaWeights:
    """The checkpoint's FP32 weights, read once for the module: an engine only reads them, so
    the engines built here share them (the module's teardown lets them go)."""
    return LlamaWeights.from_folder(MODEL_DIR, torch.float32, torch.device("cpu"), "fp32")


@pytest.fixture(scope="module", autouse=True)
def _release_weights():
    yield
    fp32_weights.cache_clear()


def make_engine(hf, **overrides) -> LLMEngine:
    tok, _ = hf
    settings = dict(
        model_dir=MODEL_DIR, num_blocks=512, block_size=16, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=4096
    )
    settings.update(overrides)
    config = EngineConfig(**settings)
    shared = (config.model_dir, config.weights_precision, config.dtype, config.device) == (MODEL_DIR, "fp32", "float32", "cpu")
    return LLMEngine(config, weights=fp32_weights() if shared else None, tokenizer=tok)


@pytest.fixture(scope="module")
def engine(hf):
    return make_engine(hf)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


def assert_same(results, reference, prompts):
    for (_, ids), ref, p in zip(results, reference, prompts):
        assert ids == ref, f"prompt {p[-60:]!r}: engine {ids} != generate() {ref}"


def test_greedy_one_at_a_time_matches_generate(engine, prompts, reference):
    cache, bm = engine.runner.cache, engine.block_manager
    hits = bm.prefix_hits
    for p, ref in zip(prompts, reference):
        in_place, gathered = cache.groups_in_place, cache.groups_gathered
        assert_same(engine.generate([p], GREEDY), [ref], [p])
        # A lone stream's blocks are consecutive (a prefix hit copied ahead of its prompt): its
        # attention read K/V where they lie in every step
        assert cache.groups_in_place > in_place and cache.groups_gathered == gathered
    assert bm.prefix_hits > hits  # the chat prompts share the template's system prompt
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_france_answer(engine, hf):
    text, _ = engine.generate([chat(hf[0], MESSAGES[0])], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert text == "The capital of France is Paris."


def test_sixteen_at_once_mixed_lengths_with_and_without_prefix_hits(hf, prompts, reference):
    eng = make_engine(hf)
    batch = (prompts * 3)[:16]
    refs = (reference * 3)[:16]
    first = eng.generate(batch, GREEDY)  # the copies admitted together share no computed block yet
    assert_same(first, refs, batch)
    hits_before = eng.block_manager.prefix_hits
    again = eng.generate(batch, GREEDY)  # now every full prompt block is cached
    assert_same(again, refs, batch)
    assert eng.block_manager.prefix_hits - hits_before > sum(len(p) for p in batch) // 8
    assert eng.block_manager.num_used_blocks == 0
    eng.block_manager.check_invariants()


def test_chunked_prefill_beside_running_streams(hf, prompts, reference):
    """A 64-token budget: the 1,500-token prompt is prefilled over many steps while the
    short streams decode every step."""
    eng = make_engine(hf, max_num_seqs=8, max_num_batched_tokens=64)
    long_i = len(prompts) - 1
    order = [0, 5, long_i, 1]
    results = eng.generate([prompts[i] for i in order], GREEDY)
    assert_same(results, [reference[i] for i in order], [prompts[i] for i in order])
    assert eng.counters["steps"] >= 1500 // 64


def test_preemption_recomputes_to_the_same_tokens(hf, prompts, reference):
    """A pool too small for all streams at once: the newest are preempted and recomputed."""
    short = prompts[:-1]
    need = max(len(hf[0].encode(p, add_special_tokens=False)) for p in short) + NEW_TOKENS
    eng = make_engine(hf, num_blocks=3 * (-(-need // 16)), enable_prefix_caching=False)
    batch = short * 2
    results = eng.generate(batch, GREEDY)
    assert eng.scheduler.num_preemptions > 0
    assert_same(results, reference[:-1] * 2, batch)
    assert eng.block_manager.num_used_blocks == 0


def test_seeded_sampling_same_alone_and_batched(engine, prompts):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate([prompts[2]], params)[0][1]
    others = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in (1, 2, 3)]
    batched = engine.generate([prompts[0], prompts[2], prompts[3], prompts[4]], [others[0], params, others[1], others[2]])
    assert batched[1][1] == alone
    other_seed = engine.generate([prompts[2]], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=4321))[0][
        1
    ]
    assert other_seed != alone


def run_choices(eng: LLMEngine, rid, prompt, params) -> tuple[dict[int, list[int]], list]:
    """Run one request with ``params.n`` choices alone: the token ids of each choice, and every output."""
    eng.add_request(rid, prompt, params)
    ids: dict[int, list[int]] = {}
    outs = []
    while eng.has_unfinished():
        for out in eng.step():
            outs.append(out)
            ids.setdefault(out.index, []).extend(out.token_ids)
    return ids, outs


@pytest.mark.parametrize("which", [0, 6], ids=["prompt-in-partial-block", "other-prompt"])
def test_n_choices_fork_one_prefill_and_share_its_blocks(hf, prompts, reference, which):
    """n = 4: one prefill (prefix caching off, so nothing but the fork can share it), three
    forked sequences; greedy choices are generate()'s tokens each, seeded choice i draws as a
    lone request seeded seed + i, and every block comes back."""
    eng = make_engine(hf, enable_prefix_caching=False)
    prompt = prompts[which]
    n_prompt = len(eng.encode(prompt))
    ids, outs = run_choices(eng, "greedy", prompt, replace(GREEDY, n=4))
    assert eng.counters["prompt_tokens_computed"] == n_prompt  # one prefill, not four
    assert eng.counters["sequences_forked"] == 3 and eng.block_manager.forks == 3
    assert sorted(ids) == [0, 1, 2, 3] and all(v == reference[which] for v in ids.values())
    finals = [o for o in outs if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2, 3]
    assert [o.last for o in outs] == [False] * (len(outs) - 1) + [True]  # the request ends once
    assert {o.num_input_tokens for o in outs} == {n_prompt}
    assert eng.block_manager.num_used_blocks == 0
    eng.block_manager.check_invariants()

    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=77, n=3)
    ids, _ = run_choices(eng, "seeded", prompt, sampled)
    for i in range(3):
        alone = eng.generate([prompt], replace(sampled, n=1, seed=77 + i))[0][1]
        assert ids[i] == alone, f"choice {i}"
    assert len({tuple(v) for v in ids.values()}) > 1
    assert eng.block_manager.num_used_blocks == 0


def test_forked_choices_share_blocks_copy_the_partial_one_and_abort_together(hf, prompts):
    eng = make_engine(hf, enable_prefix_caching=False)
    prompt = prompts[0]
    n_prompt = len(eng.encode(prompt))
    assert n_prompt % 16, "the prompt must end inside a block for a copy on write"
    eng.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=1.0, n=3, ignore_eos=True))
    produced: dict[int, int] = {}
    while len(produced) < 3 or min(produced.values()) < 3:
        produced.update((o.index, o.num_output_tokens) for o in eng.step())
    bm = eng.block_manager
    prompt_blocks = n_prompt // 16
    # The full prompt blocks are held three times; each choice has its own copy of the partial one.
    assert bm.num_used_blocks == prompt_blocks + 3 + sum(
        max(0, bm.blocks_needed(bm.num_tokens(s)) - prompt_blocks - 1) for s in eng.scheduler._seqs
    )
    bm.check_invariants()
    outs = eng.abort("r")
    assert sorted(o.index for o in outs) == [0, 1, 2] and [o.last for o in outs] == [False, False, True]
    assert all(o.finish_reason == "abort" for o in outs)
    assert bm.num_used_blocks == 0 and not eng.has_unfinished()
    bm.check_invariants()


def test_n_is_bounded_by_the_batch_and_its_places_are_held_from_admission(hf, prompts):
    eng = make_engine(hf, max_num_seqs=4)
    with pytest.raises(InputError) as err:
        eng.add_request("big", prompts[0], replace(GREEDY, n=5))
    assert err.value.field == "n" and err.value.values["maximum"] == 4
    eng.add_request("a", prompts[0], replace(GREEDY, n=3, max_tokens=4))
    eng.add_request("b", prompts[1], replace(GREEDY, n=2, max_tokens=4))
    eng.step()  # a's prompt is computed and its two other choices forked; b (two places) does not fit
    assert eng.scheduler.num_running == eng.scheduler.num_places_taken == 3 and eng.scheduler.num_waiting == 1
    while eng.has_unfinished():
        eng.step()
        assert eng.scheduler.num_places_taken <= 4


def test_stop_string_and_min_tokens(engine, hf):
    prompt = chat(hf[0], MESSAGES[0])
    text, _ = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, stop=("Paris",)))[0]
    assert text == "The capital of France is "
    # EOS is suppressed until min_tokens; ignore_eos runs to max_tokens.
    _, ids = engine.generate([prompt], SamplingParams(max_tokens=20, min_tokens=12, temperature=0.0))[0]
    assert len(ids) >= 12
    _, ids = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert len(ids) == 20


def test_stop_token_ids_include_stop_str_and_special_tokens(engine, hf):
    """vLLM's stop_token_ids end the sequence as EOS does, their text left out unless
    include_stop_str_in_output; min_tokens holds them back; skip_special_tokens false shows EOS."""
    tok = hf[0]
    prompt = chat(tok, MESSAGES[0])
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    text, ids = engine.generate([prompt], greedy)[0]
    k = 3
    stop_id = ids[k]
    first = ids.index(stop_id)
    cut_text, cut_ids = engine.generate([prompt], replace(greedy, stop_token_ids=(stop_id,)))[0]
    assert cut_ids == ids[: first + 1]  # the stop token is generated (and counted) ...
    assert cut_text == tok.decode(ids[:first], skip_special_tokens=True)  # ... but not written
    kept, _ = engine.generate([prompt], replace(greedy, stop_token_ids=(stop_id,), include_stop_str_in_output=True))[0]
    assert kept == tok.decode(ids[: first + 1], skip_special_tokens=True)
    _, late = engine.generate([prompt], replace(greedy, stop_token_ids=(stop_id,), min_tokens=first + 2, max_tokens=first + 3))[0]
    assert stop_id not in late[: first + 2]
    with_stop, _ = engine.generate([prompt], replace(greedy, stop=("Paris",), include_stop_str_in_output=True))[0]
    assert with_stop == "The capital of France is Paris"
    assert ids[-1] in engine.eos_token_ids, "the greedy answer should end with EOS within 32 tokens"
    eos_text = tok.decode([ids[-1]])
    shown, _ = engine.generate([prompt], replace(greedy, skip_special_tokens=False, include_stop_str_in_output=True))[0]
    assert shown == text + eos_text
    assert engine.generate([prompt], replace(greedy, skip_special_tokens=False))[0][0] == text  # EOS is a stop token
    vocab = engine.weights.config.vocab_size
    with pytest.raises(InputError, match="outside the vocabulary") as e:
        engine.check_request([1, 2], replace(greedy, stop_token_ids=(5, vocab)), [])
    assert (e.value.field, e.value.values) == ("stop_token_ids", {"maximum": vocab - 1, "got": vocab})


class _OpenAIPenalties:
    """A transformers LogitsProcessor of OpenAI's presence and frequency penalties over the
    generated tokens and its logit bias: the reference the engine's sampler must match."""

    def __init__(self, prompt_len: int, presence: float, frequency: float, bias: dict[int, float]):
        self.prompt_len, self.presence, self.frequency, self.bias = prompt_len, presence, frequency, bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token, value in self.bias.items():
            scores[:, token] += value
        for token, count in zip(*input_ids[0, self.prompt_len :].unique(return_counts=True)):
            scores[:, token] -= self.frequency * count.item() + self.presence
        return scores


def test_penalties_and_logit_bias_match_generate_with_the_same_processor(engine, hf):
    """Greedy, batched, three settings at once: each is token for token transformers' generate()
    with a processor of OpenAI's formulas, so the penalties look at the output alone."""
    from transformers import LogitsProcessorList

    tok, model = hf
    prompt = chat(tok, "Write a short poem about the sea, the sea, the sea.")
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    the = tok.encode(" the", add_special_tokens=False)[0]
    settings = [(0.0, 1.2, {}), (1.5, 0.0, {the: 4.0}), (0.8, 0.4, {the: -100.0})]
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=0.0,
            presence_penalty=pr,
            frequency_penalty=fr,
            logit_bias={str(k): v for k, v in b.items()},
        )
        for pr, fr, b in settings
    ]
    got = engine.generate([prompt] * 3, params)
    plain = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0][1]
    for (_, out), (pr, fr, b) in zip(got, settings):
        processors = LogitsProcessorList([_OpenAIPenalties(ids.shape[1], pr, fr, b)])
        with torch.inference_mode():
            ref = model.generate(ids, max_new_tokens=20, do_sample=False, logits_processor=processors)[0, ids.shape[1] :]
        assert out == ref.tolist()[: len(out)] and len(out) == min(20, len(ref))
        assert out != plain  # each setting changed the answer
    assert the not in got[2][1]


def run_outputs(engine, requests):
    """Each request's RequestOutputs, stepping the engine until all finish."""
    outs: dict = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def test_logprobs_are_the_models_own_and_travel_with_their_text(engine, hf):
    """The chosen token's log-probability is log-softmax of transformers' logits at that position
    (greedy, so also the first alternative); each output's entries spell exactly its text; a
    request without logprobs gets none; a stop string keeps the tokens up to it."""
    tok, model = hf
    prompt = chat(tok, "Write one sentence about the moon. Use an emoji 🌙.")
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        ref = model.generate(ids, max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref_ids = ref.sequences[0, ids.shape[1] :].tolist()
    ref_lp = [torch.log_softmax(step[0].float(), -1) for step in ref.logits]
    outs = run_outputs(
        engine,
        [
            ("lp", prompt, SamplingParams(max_tokens=24, temperature=0.0, logprobs=5)),
            ("plain", prompt, SamplingParams(max_tokens=24, temperature=0.0)),
            ("stop", prompt, SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, stop=("moon",))),
        ],
    )
    entries = [e for o in outs["lp"] for e in o.logprobs]
    assert [e.token_id for e in entries] == ref_ids[: len(entries)] and len(entries) == sum(len(o.token_ids) for o in outs["lp"])
    worst = 0.0
    for j, e in enumerate(entries):
        worst = max(worst, abs(e.logprob - ref_lp[j][e.token_id].item()))
        assert len(e.top) == 5 and e.top[0][0] == e.token_id  # greedy: the chosen one is the most likely
        assert [t for t, _ in e.top] == ref_lp[j].topk(5).indices.tolist()
        assert sum(math.exp(v) for _, v in e.top) <= 1.0 + 1e-6
    assert worst < 1e-3, worst
    for o in outs["lp"]:  # each output's entries are the bytes of its text
        assert b"".join(engine.token_bytes(e.token_id) for e in o.logprobs) == o.text.encode("utf-8")
    assert all(o.logprobs is None for o in outs["plain"])
    stopped = [e for o in outs["stop"] for e in o.logprobs]
    text = "".join(o.text for o in outs["stop"])
    assert outs["stop"][-1].finish_reason == "stop" and all(e.top == () for e in stopped)
    spelled = b"".join(engine.token_bytes(e.token_id) for e in stopped).decode("utf-8", "replace")
    assert spelled.startswith(text) and "moon" in spelled[len(text) :]


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_structured_outputs_hold_their_guide_beside_free_streams_and_through_preemption(hf, prompts):
    """Guided sequences (a JSON schema, choices, a regex; greedy and sampled) in one batch with
    unguided ones, in a pool small enough to preempt: every guided output matches its guide, the
    unguided ones are generate()'s, min_tokens does not outlast a finished guide."""
    import json
    import re

    import jsonschema

    tok = hf[0]
    ask = [chat(tok, m) for m in ("Describe a person as JSON.", "Is the sea salty?", "Give me a phone number.")]
    guided = [
        (ask[0], SamplingParams(max_tokens=64, temperature=0.0, guided_json=PERSON)),
        (ask[0], SamplingParams(max_tokens=64, temperature=0.8, seed=3, guided_json=PERSON)),
        (ask[1], SamplingParams(max_tokens=16, temperature=0.8, seed=5, min_tokens=8, guided_choice=["yes", "no"])),
        (ask[2], SamplingParams(max_tokens=16, temperature=0.0, guided_regex=r"[0-9]{3}-[0-9]{4}")),
    ]
    free = [(p, GREEDY) for p in prompts[:3]]
    need = max(len(tok.encode(p, add_special_tokens=False)) for p, _ in guided + free) + 64
    eng = make_engine(hf, num_blocks=-(-need // 16) + 2, enable_prefix_caching=False)
    batch = guided + free
    results = eng.generate([p for p, _ in batch], [q for _, q in batch])
    assert eng.scheduler.num_preemptions > 0
    for text in (results[0][0], results[1][0]):
        jsonschema.validate(json.loads(text), PERSON)
    assert results[2][0] in ("yes", "no") and len(results[2][1]) <= 3  # EOS after the choice, min_tokens or not
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", results[3][0])
    for (_, ids), p in zip(results[4:], prompts[:3]):
        assert ids == hf_greedy(hf, p, NEW_TOKENS)
    assert eng.block_manager.num_used_blocks == 0


def test_a_bad_guide_is_refused_at_admission_naming_its_field(engine):
    with pytest.raises(InputError) as caught:
        engine.add_request("g", [1, 2], SamplingParams(guided_regex="a(b"))
    assert caught.value.field == "guided_regex" and "unclosed group" in str(caught.value)
    assert not engine.has_unfinished()


COPY_TEXT = (
    "def moving_average(values, window):\n    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n"
    "        total += v\n        if i >= window:\n            total -= values[i - window]\n"
    "        out.append(total / min(i + 1, window))\n    return out\n"
)


@pytest.fixture(scope="module")
def copy_prompt(hf):
    """A prompt whose answer quotes it: what prompt-lookup drafts are for."""
    return chat(hf[0], "Rewrite this function with the name rolling_mean, changing nothing else:\n" + COPY_TEXT)


def hf_greedy(hf, prompt: str, n: int) -> list[int]:
    tok, model = hf
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1] :].tolist()


def test_speculative_decoding_gives_generates_tokens_in_fewer_steps(hf, prompts, reference, copy_prompt):
    """Prompt-lookup drafts, verified in the step: FP32 greedy tokens stay generate()'s, one
    request alone and all at once, and the quoting answer takes fewer steps than tokens."""
    eng = make_engine(hf, num_speculative_tokens=4, speculative_max_seqs=32)
    # Sampled requests never draft: on a fresh engine the same seed gives the same tokens as without.
    seeded = SamplingParams(max_tokens=16, temperature=0.9, seed=5)
    assert eng.generate([copy_prompt], seeded)[0][1] == make_engine(hf).generate([copy_prompt], seeded)[0][1]
    assert eng.counters["spec_draft_tokens"] == 0
    eng.counters.clear()
    copy_ref = hf_greedy(hf, copy_prompt, 64)
    ((_, ids),) = eng.generate([copy_prompt], SamplingParams(max_tokens=64, temperature=0.0))
    assert ids == copy_ref
    assert eng.counters["spec_accepted_tokens"] >= 16, eng.counters
    assert eng.counters["steps"] <= 64 - 16
    batch = prompts + [copy_prompt]
    everyone = eng.generate(batch, GREEDY)
    assert_same(everyone, reference + [copy_ref[:NEW_TOKENS]], batch)
    assert eng.block_manager.num_used_blocks == 0
    eng.block_manager.check_invariants()


def test_speculative_decoding_stops_where_one_token_at_a_time_stops(hf, copy_prompt):
    """A stop string, EOS, min_tokens or max_tokens reached inside an accepted draft ends the
    output there, as without drafts."""
    plain, drafted = make_engine(hf), make_engine(hf, num_speculative_tokens=6)
    for params in (
        SamplingParams(max_tokens=7, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, stop=("(window - 1)",)),
        SamplingParams(max_tokens=100, temperature=0.0),
        SamplingParams(max_tokens=100, min_tokens=98, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.2),
    ):
        want = plain.generate([copy_prompt], params)[0]
        got = drafted.generate([copy_prompt], params)[0]
        assert got == want, params
    assert drafted.counters["spec_accepted_tokens"] > 0
    assert drafted.block_manager.num_used_blocks == 0
    drafted.block_manager.check_invariants()


def test_bad_requests_name_the_field(engine):
    with pytest.raises(InputError, match="text_input"):
        engine.add_request("a", "   ", GREEDY)
    with pytest.raises(ContextTooLong, match="3500 tokens and max_tokens is 1000: 4500 exceeds the context limit of 4096"):
        engine.add_request("b", [1] * 3500, SamplingParams(max_tokens=1000))
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.add_request("c", [1, 10**9], GREEDY)
    vocab = engine.weights.config.vocab_size
    with pytest.raises(InputError) as caught:
        engine.add_request("d", [1, 2], SamplingParams(temperature=0.0, logit_bias={"3": 1, str(vocab): 5}))
    assert caught.value.field == f"logit_bias['{vocab}']" and caught.value.values == {"maximum": vocab - 1}
    assert not engine.has_unfinished()


def test_the_engine_checks_context_and_pool_once_with_the_numbers_as_data(hf, engine):
    with pytest.raises(ContextTooLong) as e:
        engine.check_request([1] * 3500, SamplingParams(max_tokens=1000))
    assert (e.value.code, e.value.field) == ("context_length_exceeded", "max_tokens")
    assert e.value.values == {"prompt_tokens": 3500, "max_tokens": 1000, "limit": 4096}
    assert engine.check_request([1] * 3096, SamplingParams(max_tokens=1000)).max_tokens == 1000  # exactly the limit
    with pytest.raises(InputError, match="no tokens"):
        engine.check_request([], GREEDY)
    # Larger than the whole pool could ever hold: refused now, not queued forever.
    small = make_engine(hf, num_blocks=4, block_size=4, max_model_len=1000)
    with pytest.raises(ContextTooLong, match="the KV pool holds 16 tokens") as e:
        small.check_request(list(range(10)), SamplingParams(max_tokens=10))
    assert e.value.values["limit"] == 17


def test_fit_to_context_lowers_max_tokens_to_the_room_left(engine):
    fit = SamplingParams(max_tokens=16, min_tokens=12, fit_to_context=True)
    fitted = engine.check_request([1] * 4086, fit)
    assert (fitted.max_tokens, fitted.min_tokens) == (10, 10)
    assert engine.check_request([1] * 100, fit) == fit  # room enough: unchanged
    with pytest.raises(ContextTooLong):  # no room at all
        engine.check_request([1] * 4096, fit)
    rid = "fit"
    engine.add_request(rid, [1] * 4090, SamplingParams(max_tokens=2048, temperature=0.0, ignore_eos=True, fit_to_context=True))
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.finished]
    assert [(o.num_input_tokens, o.num_output_tokens, o.finish_reason) for o in outputs] == [(4090, 6, "length")]


CONTINUED = {
    "greedy": SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=28, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True),
    # min_tokens, the presence and frequency penalties and a stop string count the tokens before the cut
    "penalised": SamplingParams(
        max_tokens=28, min_tokens=20, temperature=0.8, seed=7, presence_penalty=0.5, frequency_penalty=0.7, stop=("\n\n",)
    ),
}


@pytest.mark.parametrize("kind", sorted(CONTINUED))
def test_a_stream_continued_after_its_first_pieces_gives_the_uninterrupted_answer(engine, prompts, kind):
    """A replica died after sending some pieces: the request sent again with their token ids as
    prefix_ids produces exactly the rest of the answer (text, ids, counts, finish reason), the
    sampled kinds included (their generator draws past the prefix)."""
    params = CONTINUED[kind]
    prompt = prompts[4 if kind == "greedy" else 1]
    whole = run_outputs(engine, [("whole", prompt, params)])["whole"]
    assert len(whole) > 8
    for cut in (1, 5, len(whole) - 2):
        sent = whole[:cut]
        prefix = [t for o in sent for t in o.token_ids]
        engine.add_request("rest", prompt, params, prefix_ids=prefix)
        rest = []
        while engine.has_unfinished():
            rest += engine.step()
        assert "".join(o.text for o in sent + rest) == "".join(o.text for o in whole), (kind, cut)
        assert prefix + [t for o in rest for t in o.token_ids] == [t for o in whole for t in o.token_ids]
        assert [o.num_output_tokens for o in rest] == [o.num_output_tokens for o in whole[cut:]]
        assert (rest[-1].finish_reason, rest[-1].num_input_tokens) == (whole[-1].finish_reason, whole[-1].num_input_tokens)
    assert engine.block_manager.num_used_blocks == 0


def test_a_continuation_is_checked_once_with_its_field_and_numbers(engine):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(InputError) as e:
        engine.check_request([1, 2], params, [5, 6, 7, 8])
    assert (e.value.field, e.value.values) == ("prefix_token_ids", {"maximum": 3, "got": 4})
    vocab = engine.weights.config.vocab_size
    with pytest.raises(InputError, match="outside the vocabulary") as e:
        engine.check_request([1, 2], params, [vocab])
    assert e.value.field == "prefix_token_ids"
    with pytest.raises(InputError, match="n=2"):
        engine.check_request([1, 2], replace(params, n=2), [5])
    with pytest.raises(InputError, match="log-probabilities"):
        engine.check_request([1, 2], replace(params, logprobs=0), [5])
    assert engine.check_request([1, 2], params, [5, 6, 7]) == params
    assert not engine.has_unfinished()


def test_abort_mid_stream_frees_blocks_and_random_load_leaks_nothing(hf, prompts):
    eng = make_engine(hf, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=128)
    rng = random.Random(3)
    free0 = eng.block_manager.num_free_blocks
    live: dict[int, int] = {}
    finished = 0
    for rid in range(60):
        p = rng.choice(prompts[:-1])
        eng.add_request(rid, p, SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True))
        live[rid] = rng.random() < 0.2  # cancel this one mid-stream
        for out in eng.step():
            if out.finished:
                finished += 1
                live.pop(out.request_id, None)
            elif live.get(out.request_id) and out.num_output_tokens >= 2:
                assert [o.finish_reason for o in eng.abort(out.request_id)] == ["abort"]
                finished += 1
                live.pop(out.request_id)
    while eng.has_unfinished():
        for out in eng.step():
            finished += out.finished
    assert finished == 60
    assert eng.block_manager.num_free_blocks == free0
    assert eng.scheduler.num_running == eng.scheduler.num_waiting == 0
    eng.block_manager.check_invariants()


def test_loop_streams_cancels_within_a_step_and_refuses_when_full(hf, prompts):
    eng = make_engine(hf, max_num_seqs=4, max_waiting=2)
    loop = EngineLoop(eng)
    try:
        got: dict[int, list] = {0: [], 1: []}
        done = {0: threading.Event(), 1: threading.Event()}
        cancel = threading.Event()

        def collect(rid):
            def on_output(out):
                got[rid].append(out)
                if out.finished:
                    done[rid].set()

            return on_output

        loop.submit(0, prompts[0], SamplingParams(max_tokens=8, temperature=0.0), collect(0))
        loop.submit(
            1,
            prompts[4],
            SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True),
            collect(1),
            is_cancelled=cancel.is_set,
        )
        assert done[0].wait(60)
        assert "".join(o.text for o in got[0]) == "The capital of France is Paris."
        deadline = time.monotonic() + 60
        while len(got[1]) < 3:
            assert time.monotonic() < deadline, "the long request streamed nothing in 60 s"
            time.sleep(0.01)
        cancel.set()
        assert done[1].wait(60)
        last = got[1][-1]
        assert last.finished and last.finish_reason == "abort"
        assert last.num_output_tokens < 1000
        # LLMEngine.abort frees the blocks before it returns the final output
        assert eng.block_manager.num_used_blocks == 0
        with pytest.raises(InputError, match="max_tokens"):
            loop.submit(2, [1] * 4000, SamplingParams(max_tokens=200), collect(0))
        # Fill the running batch (4) and the queue (2), then one more is refused.
        blockers = [threading.Event() for _ in range(6)]
        for i in range(6):
            loop.submit(
                10 + i,
                prompts[1],
                SamplingParams(max_tokens=2000, ignore_eos=True),
                lambda o: None,
                is_cancelled=blockers[i].is_set,
            )
            if i == 3:
                deadline = time.monotonic() + 60
                while eng.scheduler.num_running < 4 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert eng.scheduler.num_running == 4, "the running batch did not fill in 60 s"
        with pytest.raises(QueueFull, match="max_waiting=2"):
            loop.submit(20, prompts[1], GREEDY, lambda o: None)
        for b in blockers:
            b.set()
    finally:
        loop.shutdown()


def test_admission_window_lets_a_burst_share_its_first_step(hf, prompts):
    """A burst's first request does not get a step alone: requests arriving within the window
    (after the engine was idle, and after a step finished requests whose clients send the next
    ones) are prefilled in the same step. Without the window the first of each burst ran alone.

    Quiet time = window = 1 s, far from the burst's 20 ms spacing on a busy machine: the second
    window ends when the two expected requests came, or, without that rule, after the quiet second."""
    eng = make_engine(hf, admission_window_ms=1000, admission_quiet_ms=1000)
    loop = EngineLoop(eng)
    firsts: dict[str, float] = {}
    done = {k: threading.Event() for k in "ABCD"}
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    waits_before_c: list[tuple[int, float]] = []  # the windows waited when A finished

    def on_output(key, then=None):
        def cb(out):
            if key not in firsts and out.metrics is not None and out.metrics.first_scheduled is not None:
                firsts[key] = out.metrics.first_scheduled
            if out.finished:
                if key == "A":
                    waits_before_c.append((loop.admission_waits, loop.admission_wait_s))
                done[key].set()
                if then is not None:  # the client's next request (a closed loop)
                    nxt = then[0]
                    if then[1] == 0:  # at once, before the engine thread records the step's end
                        loop.submit(nxt, prompts[2], short, on_output(nxt))
                    else:  # a few ms later
                        threading.Timer(then[1], lambda: loop.submit(nxt, prompts[2], short, on_output(nxt))).start()

        return cb

    try:
        loop.submit("A", prompts[0], short, on_output("A", ("C", 0)))
        time.sleep(0.02)  # B comes 20 ms after A: the engine woke for A, and waited
        loop.submit("B", prompts[1], short, on_output("B", ("D", 0.015)))
        for k in "ABCD":
            assert done[k].wait(120), k
        assert firsts["A"] == firsts["B"], "A and B (20 ms apart, the engine idle) were not prefilled together"
        assert firsts["C"] == firsts["D"], "C and D (sent as A and B finished) were not prefilled together"
        # The window for C and D ended as soon as both came (D 15 ms after C), not at the quiet time.
        ((waits_at_c, waited_at_c),) = waits_before_c
        assert waits_at_c >= 1 and loop.admission_waits == waits_at_c + 1, (waits_before_c, loop.admission_waits)
        second = loop.admission_wait_s - waited_at_c
        assert second < 0.5, f"the window for C and D lasted {second:.3f} s: it waited for the quiet time (1 s)"
    finally:
        loop.shutdown()


def test_admission_window_is_bounded_and_off_at_zero(hf, prompts):
    with pytest.raises(ConfigError, match="admission_window_ms"):
        EngineConfig(model_dir=MODEL_DIR, admission_window_ms=5000)
    eng = make_engine(hf, admission_window_ms=0)
    loop = EngineLoop(eng)
    try:
        done = threading.Event()
        loop.submit(
            "solo", prompts[0], SamplingParams(max_tokens=2, temperature=0.0), lambda out: done.set() if out.finished else None
        )
        assert done.wait(60)
        assert loop.admission_waits == 0 and loop.admission_wait_s == 0
    finally:
        loop.shutdown()


def test_a_request_that_fails_its_step_fails_alone_and_the_others_finish_unchanged(hf, prompts, reference):
    """Issue 23 item 7: an exception inside a step used to fail every request of that step. A
    request whose decode makes the model run raise (injected here, at its first decode, while 15
    streams run beside it) gets the error; the 15 others finish with the tokens they have alone."""
    eng = make_engine(hf)
    batch, refs = (prompts * 3)[:15], (reference * 3)[:15]
    real = eng.runner.execute

    def execute(plan):
        if any(c.seq_id == "poison" and not c.is_prefill for c in plan.chunks):
            raise RuntimeError("injected failure")
        return real(plan)

    eng.runner.execute = execute
    for i, p in enumerate(batch):
        eng.add_request(i, p, GREEDY)
    eng.add_request("poison", prompts[0], GREEDY)
    tokens: dict = {i: [] for i in range(len(batch))}
    errors: dict = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            elif out.request_id in tokens:
                tokens[out.request_id].extend(out.token_ids)
    assert list(errors) == ["poison"] and "injected failure" in str(errors["poison"])
    for i, ref in enumerate(refs):
        assert tokens[i] == ref, f"request {i}: {tokens[i]} != {ref}"
    assert eng.counters["steps_isolated"] >= 1 and eng.counters["requests_failed_alone"] == 1
    assert eng.block_manager.num_used_blocks == 0
    eng.block_manager.check_invariants()


def test_a_step_that_fails_for_every_request_still_raises(hf, prompts):
    eng = make_engine(hf)
    eng.runner.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("the model is broken"))
    for i, p in enumerate(prompts[:3]):
        eng.add_request(i, p, GREEDY)
    with pytest.raises(RuntimeError, match="the model is broken"):
        eng.step()


def test_each_output_says_how_many_prompt_tokens_the_prefix_cache_held(hf, prompts):
    eng = make_engine(hf)
    prompt = prompts[-1]  # about 1,500 tokens
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def outputs(request_id):
        eng.add_request(request_id, prompt, params)
        out = []
        while eng.has_unfinished():
            out += eng.step()
        return out

    first, again = outputs("first"), outputs("again")
    assert {o.num_cached_tokens for o in first} == {0}
    cached = {o.num_cached_tokens for o in again}
    n_prompt = again[-1].num_input_tokens
    # Every full block of the prompt but the last one's tail: a multiple of the block size.
    assert len(cached) == 1 and 0 < cached.pop() <= n_prompt and again[-1].num_cached_tokens % 16 == 0
    assert again[-1].num_cached_tokens >= n_prompt - 32, (again[-1].num_cached_tokens, n_prompt)
