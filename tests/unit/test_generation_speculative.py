"""Prompt-lookup speculative decoding without a model: the proposer, acceptance, and the
scheduler and block manager carrying drafts.

A fake runner stands in for the model (``generation_fakes.FakeRunner``): it writes each chunk's
tokens at the planned slots, reads every row's context back through the block table and
"samples" a fixed function of that context. The function repeats the context with a
period, except at some positions, so drafts are sometimes right and sometimes wrong; the
output must be exactly what one-token-at-a-time decoding gives, and the pool's bookkeeping
must hold after every step.
"""

from __future__ import annotations

import random

import pytest

from python_backends.generation.block_manager import BlockManager
from python_backends.generation.scheduler import Scheduler
from python_backends.generation.speculative import accept_draft, propose_ngram
from tests.unit.generation_fakes import FakeRunner


# ---- the proposer -------------------------------------------------------------------------
def test_proposes_what_followed_the_latest_occurrence_of_the_longest_ngram():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    # "2 3" occurred at 1 and 5: the latest (5) is followed by 5 6 7
    assert propose_ngram(tokens, 3) == [5, 6, 7]
    assert propose_ngram(tokens, 1) == [5]
    # a longer n-gram wins over a more recent shorter one: "1 2 3" at 0 -> 4 9
    assert propose_ngram([1, 2, 3, 4, 9, 8, 2, 3, 7, 1, 2, 3], 2) == [4, 9]
    # the continuation is cut at the sequence's end
    assert propose_ngram([5, 6, 5, 6], 4) == [5, 6]


def test_no_draft_without_a_repeated_ngram_or_room():
    assert propose_ngram([1, 2, 3, 4, 5], 4) == []
    assert propose_ngram([7, 7, 7, 7], 0) == []
    assert propose_ngram([7], 3) == []
    assert propose_ngram([], 3) == []
    # a single repeated token is not enough (min n-gram 2)
    assert propose_ngram([1, 9, 2, 3, 4, 9], 2) == []


def test_lookback_bounds_the_search():
    tokens = [1, 2, 42] + [0] * 50 + list(range(100, 150)) + [1, 2]
    assert propose_ngram(tokens, 1) == [42]
    assert propose_ngram(tokens, 1, lookback=60) == []


def test_accept_draft_keeps_the_agreeing_prefix_then_the_models_token():
    assert accept_draft([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus a bonus token
    assert accept_draft([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # second differs: the model's 9 ends it
    assert accept_draft([5, 6, 7], [4, 6, 7, 8]) == [4]
    with pytest.raises(ValueError):
        accept_draft([5, 6], [5, 6])


# ---- the block manager --------------------------------------------------------------------
def test_truncate_drops_a_rejected_draft_and_frees_its_blocks():
    bm = BlockManager(8, 4)
    bm.allocate("a", [1, 2, 3])
    bm.mark_computed("a", 3)
    assert bm.can_append_slots("a", 1 + 4 * 7) and not bm.can_append_slots("a", 2 + 4 * 7)
    for t in [4, 5, 6, 7, 8, 9]:  # the last token and a draft of five, into a second and third block
        bm.append_slot("a", t)
    assert len(bm.block_table("a")) == 3
    bm.truncate("a", 5)  # one draft token accepted
    assert bm.num_tokens("a") == 5 and len(bm.block_table("a")) == 2
    assert bm.num_free_blocks == 6
    bm.check_invariants()
    with pytest.raises(ValueError):
        bm.truncate("a", 6)  # cannot grow
    bm.mark_computed("a", 5)
    with pytest.raises(ValueError):
        bm.truncate("a", 4)  # computed tokens stay
    bm.free("a")
    bm.check_invariants()


# ---- the scheduler with drafts ------------------------------------------------------------
def periodic_token(context: list[int]) -> int:
    """Repeats the context with period 5, except every 7th position: drafts right and wrong."""
    n = len(context)
    if n % 7 == 0:
        return (sum(context) * 31 + n) % 97 + 3
    return context[-5] if n >= 5 else n + 3


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(max_tokens):
        ctx.append(periodic_token(ctx))
    return ctx[len(prompt) :]


def run(sched: Scheduler, runner: FakeRunner, outputs: dict, max_steps: int = 5000) -> int:
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        new = sched.update(out, runner.step(sched, out))
        for seq in new:
            assert 1 <= seq.num_new_tokens
            outputs[seq.seq_id] = list(seq.output_tokens)
        sched.bm.check_invariants()
        steps += 1
        assert steps < max_steps
    return steps


@pytest.mark.parametrize("prefix", [True, False])
def test_drafted_decoding_gives_one_token_at_a_time_output_in_fewer_steps(prefix):
    rng = random.Random(3)
    prompts = {f"s{i}": [rng.randrange(3, 100) for _ in range(rng.randrange(3, 30))] for i in range(6)}
    lengths = {sid: rng.randrange(1, 60) for sid in prompts}

    def go(k: int, max_seqs: int) -> tuple[dict, int, FakeRunner]:
        bm = BlockManager(128, 4, enable_prefix_caching=prefix)
        sched = Scheduler(
            bm,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_waiting=100,
            max_model_len=512,
            num_speculative_tokens=k,
            speculative_max_seqs=max_seqs,
        )
        for sid, p in prompts.items():
            sched.add(sid, p, lengths[sid], speculative=True)
        outputs: dict = {}
        runner = FakeRunner(bm, periodic_token)
        steps = run(sched, runner, outputs)
        assert bm.num_used_blocks == 0
        return outputs, steps, runner

    plain, plain_steps, plain_runner = go(0, 0)
    for sid, p in prompts.items():
        assert plain[sid] == reference(p, lengths[sid])
    for k, max_seqs in ((1, 4), (3, 4), (6, 2)):
        drafted, steps, runner = go(k, max_seqs)
        assert drafted == plain, (k, max_seqs)
        assert runner.accepted > 0 and runner.drafted > runner.accepted, "drafts right and wrong"
        assert steps < plain_steps
        assert plain_runner.drafted == 0


def test_drafts_respect_max_tokens_the_flag_and_the_batch_limit():
    bm = BlockManager(64, 4)
    sched = Scheduler(
        bm,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_waiting=10,
        max_model_len=256,
        num_speculative_tokens=8,
        speculative_max_seqs=1,
    )
    sched.add("a", [1, 2, 3, 4, 5] * 3, 3, speculative=True)
    runner = FakeRunner(bm, periodic_token)
    out = sched.schedule()
    sched.update(out, runner.step(sched, out))  # prefill: first token
    out = sched.schedule()
    (chunk,) = out.decodes
    assert len(chunk.draft) == 1, "max_tokens 3 with one token out leaves room for one draft token"
    # A sequence not marked speculative never drafts; two decoding sequences exceed speculative_max_seqs 1.
    sched2 = Scheduler(
        BlockManager(64, 4),
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_waiting=10,
        max_model_len=256,
        num_speculative_tokens=4,
        speculative_max_seqs=1,
    )
    r2 = FakeRunner(sched2.bm, periodic_token)
    sched2.add("plain", [1, 2, 3, 1, 2, 3, 1, 2], 20, speculative=False)
    out = sched2.schedule()
    sched2.update(out, r2.step(sched2, out))
    for _ in range(3):
        out = sched2.schedule()
        assert all(not c.draft for c in out.chunks)
        sched2.update(out, r2.step(sched2, out))
    sched2.add("b", [1, 2, 3, 1, 2, 3, 1, 2], 20, speculative=True)
    sched2.add("c", [1, 2, 3, 1, 2, 3, 1, 2], 20, speculative=True)
    out = sched2.schedule()
    sched2.update(out, r2.step(sched2, out))
    out = sched2.schedule()
    assert len(out.decodes) == 3 and all(not c.draft for c in out.chunks)


def test_drafts_in_a_pool_with_one_free_block():
    # 5 blocks of 4: the sequence holds 4 after its prompt, its drafts take the last one.
    bm = BlockManager(5, 4, enable_prefix_caching=False)
    sched = Scheduler(
        bm,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        max_waiting=10,
        max_model_len=64,
        num_speculative_tokens=8,
        speculative_max_seqs=2,
    )
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1]
    sched.add("a", prompt, 6, speculative=True)
    runner = FakeRunner(bm, periodic_token)
    outputs: dict = {}
    run(sched, runner, outputs)
    assert outputs["a"] == reference(prompt, 6) and runner.drafted > 0
    assert bm.num_used_blocks == 0
