"""python_backends.generation.scheduler: token budget, chunked prefill, preemption, abort, admission.

A fake runner stands in for the model (``generation_fakes.FakeRunner``): it writes each chunk's
tokens into a fake KV store at the planned slots, reads the whole context back through the block
table, and "samples" a token that is a fixed function of that context. So a wrong slot, a wrongly shared
prefix block or a wrong recompute after preemption changes the generated tokens.
"""

from __future__ import annotations

import random

import pytest

from python_backends.generation.block_manager import BlockManager
from python_backends.generation.scheduler import (
    FinishReason,
    QueueFull,
    Scheduler,
    SequenceStatus,
)
from tests.unit.generation_fakes import FakeRunner


def next_token(context: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(context)) * 31 + len(context)) % 97 + 3


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(max_tokens):
        ctx.append(next_token(ctx))
    return ctx[len(prompt) :]


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_waiting=100, max_len=512, prefix=True, with_decodes=0):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_waiting=max_waiting,
        max_model_len=max_len,
        prefill_tokens_with_decodes=with_decodes,
    )
    return bm, sched, FakeRunner(bm, next_token)


def run_to_end(sched, runner, max_steps=10_000, on_step=None):
    done = {}
    for step in range(max_steps):
        if not sched.has_unfinished():
            return done, step
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.chunks) <= sched.max_num_seqs
        if on_step:
            on_step(step, out)
        for seq in sched.update(out, runner.step(sched, out)):
            if seq.is_finished:
                done[seq.seq_id] = seq
        sched.bm.check_invariants()
    raise AssertionError("the scheduler did not finish")


def test_all_sequences_complete_with_the_reference_tokens_and_the_pool_returns():
    bm, sched, runner = make()
    rng = random.Random(7)
    prompts = {i: [rng.randrange(90) for _ in range(rng.randrange(1, 40))] for i in range(20)}
    for i, p in prompts.items():
        sched.add(i, p, max_tokens=rng.randrange(1, 20))
    done, _ = run_to_end(sched, runner)
    assert set(done) == set(prompts)
    for i, seq in done.items():
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.output_tokens == reference_output(prompts[i], seq.max_tokens)
    assert bm.num_free_blocks == bm.num_blocks


def test_budget_and_seq_cap_hold_every_step_and_decodes_come_first():
    _bm, sched, runner = make(max_num_seqs=4, budget=10)
    for i in range(10):
        sched.add(i, list(range(1, 30)), max_tokens=5)

    def check(step, out):
        assert out.num_batched_tokens <= 10 and len(out.chunks) <= 4
        assert all(c.num_tokens == 1 and not c.is_prefill for c in out.decodes)
        assert len({c.seq_id for c in out.chunks}) == len(out.chunks)

    done, _ = run_to_end(sched, runner, on_step=check)
    assert len(done) == 10


def test_a_long_prompt_is_chunked_while_running_decodes_get_a_token_every_step():
    bm, sched, runner = make(num_blocks=128, budget=16)
    for i in range(3):
        sched.add(f"short{i}", [5, 6, 7], max_tokens=60)
    # Bring the three into decode.
    while any(s.num_computed_tokens < 3 for s in sched.running) or sched.waiting:
        out = sched.schedule()
        sched.update(out, runner.step(sched, out))
    sched.add("long", list(range(1, 101)), max_tokens=4)
    chunks = []
    while sched.get("long").num_computed_tokens < 100:
        out = sched.schedule()
        assert sorted(c.seq_id for c in out.decodes) == ["short0", "short1", "short2"]
        assert [c.seq_id for c in out.prefills] == ["long"]
        # The budget is filled: 3 decodes + 13 prompt tokens (the last chunk is what is left).
        assert out.num_batched_tokens == min(16, 3 + 100 - sched.get("long").num_computed_tokens)
        chunks.append(out.prefills[0])
        sched.update(out, runner.step(sched, out))
    assert [c.num_tokens for c in chunks] == [13] * 7 + [9]
    assert [c.samples for c in chunks] == [False] * 7 + [True]
    assert [c.start for c in chunks] == [13 * k for k in range(8)]
    done, _ = run_to_end(sched, runner)
    assert done["long"].output_tokens == reference_output(list(range(1, 101)), 4)
    assert bm.num_free_blocks == bm.num_blocks


def test_prefill_tokens_with_decodes_caps_the_prompt_share_of_a_step_that_carries_decodes():
    bm, sched, runner = make(num_blocks=128, budget=32, with_decodes=8)
    sched.add("first", list(range(1, 41)), max_tokens=30)
    out = sched.schedule()  # nothing decodes yet: the prompt gets the whole budget
    assert [(c.seq_id, c.num_tokens) for c in out.prefills] == [("first", 32)]
    sched.update(out, runner.step(sched, out))
    sched.add("second", list(range(50, 90)), max_tokens=3)
    out = sched.schedule()  # "first" still in prefill: no decode, the whole budget again
    assert [(c.seq_id, c.num_tokens) for c in out.prefills] == [("first", 8), ("second", 24)]
    sched.update(out, runner.step(sched, out))
    sizes = []
    while sched.get("second").num_computed_tokens < 40:
        out = sched.schedule()
        assert [c.seq_id for c in out.decodes] == ["first"]
        assert sum(c.num_tokens for c in out.prefills) <= 8
        sizes.append(out.prefills[0].num_tokens)
        sched.update(out, runner.step(sched, out))
    assert sizes == [8, 8]
    done, _ = run_to_end(sched, runner)
    assert done["second"].output_tokens == reference_output(list(range(50, 90)), 3)
    assert done["first"].output_tokens == reference_output(list(range(1, 41)), 30)
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_by_recompute_then_resume_completes_everything_without_a_leak():
    # 12 blocks of 4 tokens: 6 sequences of 6 prompt tokens fit at admission, not grown.
    bm, sched, runner = make(num_blocks=12, block_size=4, max_num_seqs=6, budget=64)
    rng = random.Random(3)
    prompts = {i: [rng.randrange(90) for _ in range(6)] for i in range(6)}
    for i, p in prompts.items():
        sched.add(i, p, max_tokens=14)  # 6 + 14 - 1 = 19 slots = 5 blocks each at the end
    preempted = []
    done, _ = run_to_end(sched, runner, on_step=lambda s, out: preempted.extend(out.preempted))
    assert preempted, "the pool was meant to run short"
    assert sched.num_preemptions == len(preempted)
    # The newest is preempted first.
    assert preempted[0] == 5
    for i, seq in done.items():
        assert seq.output_tokens == reference_output(prompts[i], 14), i
    assert sum(s.num_preemptions for s in done.values()) == len(preempted)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0


def test_a_preempted_sequence_goes_back_to_the_front_of_waiting():
    bm, sched, runner = make(num_blocks=4, block_size=2, max_num_seqs=4, budget=16)
    sched.add("a", [1, 2, 3, 4], max_tokens=4)
    sched.add("b", [5, 6, 7, 8], max_tokens=4)
    out = sched.schedule()
    sched.update(out, runner.step(sched, out))
    sched.add("c", [7], max_tokens=1)  # waits: the pool is full
    out = sched.schedule()  # a's next token needs a third block: none is free
    sched.update(out, runner.step(sched, out))
    assert out.preempted == ["b"]
    assert [s.seq_id for s in sched.waiting] == ["b", "c"]
    b = sched.get("b")
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert len(b.output_tokens) == 1  # recomputed from prompt + what it generated
    bm.check_invariants()


def test_abort_mid_prefill_and_mid_decode_frees_blocks_at_once():
    bm, sched, runner = make(num_blocks=64, block_size=4, budget=8)
    sched.add("pre", list(range(40)), max_tokens=5)
    sched.add("dec", [1, 2], max_tokens=50)
    out = sched.schedule()
    sched.update(out, runner.step(sched, out))
    assert 0 < sched.get("pre").num_computed_tokens < 40
    used = bm.num_used_blocks
    assert sched.abort("pre") is True
    assert bm.num_used_blocks == used - 10 and not bm.has("pre")
    assert sched.abort("pre") is False  # idempotent
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, runner.step(sched, out))
    assert sched.get("dec").num_computed_tokens >= 3
    out = sched.schedule()  # cancelled while the step runs: its result is dropped
    sampled = runner.step(sched, out)
    assert sched.abort("dec")
    assert sched.update(out, sampled) == []
    assert bm.num_free_blocks == bm.num_blocks
    assert not sched.has_unfinished() and sched.schedule().is_empty
    # A waiting request can be cancelled too.
    sched.add("w", [1], max_tokens=1)
    assert sched.abort("w") and sched.num_waiting == 0


def test_queue_full_is_a_clear_error_beyond_max_waiting():
    _, sched, _ = make(max_num_seqs=2, max_waiting=2)
    for i in range(4):  # two the batch will take, two waiting
        sched.add(i, [1], 5)
    with pytest.raises(QueueFull, match="max_num_seqs=2, max_waiting=2"):
        sched.add(4, [1], 5)
    sched.schedule()  # two admitted: the batch is full, two wait
    with pytest.raises(QueueFull, match="max_waiting=2"):
        sched.add(4, [1], 5)
    sched.abort(0)  # a place in the batch: one more may queue
    sched.add(4, [1], 5)


def test_the_scheduler_trusts_the_engine_and_asserts_what_it_admitted():
    # The engine's check_request refuses these with messages (test_generation_engine.py).
    _, sched, _ = make(max_len=100)
    sched.add("y", list(range(80)), max_tokens=20)  # exactly the limit is fine
    for prompt, max_tokens in ((list(range(90)), 20), ([], 5), ([1], 0)):
        with pytest.raises(AssertionError):
            sched.add("z", prompt, max_tokens=max_tokens)
    _, small, _ = make(num_blocks=4, block_size=4, max_len=1000)
    with pytest.raises(AssertionError):
        small.add("big", list(range(10)), max_tokens=10)


def test_waiting_requests_are_admitted_first_come_first_served():
    bm, sched, runner = make(num_blocks=6, block_size=4, max_num_seqs=8, budget=64)
    sched.add("hog", list(range(16)), max_tokens=2)  # 4 blocks
    sched.add("big", list(range(12)), max_tokens=2)  # 3 blocks: must wait for hog
    sched.add("small", [1], max_tokens=2)  # would fit now, but must not jump the queue
    out = sched.schedule()
    assert [c.seq_id for c in out.prefills] == ["hog"]
    assert [s.seq_id for s in sched.waiting] == ["big", "small"]
    sched.update(out, runner.step(sched, out))
    admitted = ["hog"]

    def record(step, out):
        admitted.extend(c.seq_id for c in out.prefills if c.seq_id not in admitted)

    done, _ = run_to_end(sched, runner, on_step=record)
    assert set(done) == {"hog", "big", "small"}
    assert admitted == ["hog", "big", "small"]
    assert bm.num_free_blocks == bm.num_blocks


def test_a_shared_prefix_is_not_recomputed_for_the_next_request():
    bm, sched, runner = make(num_blocks=64, block_size=4, budget=64)
    system = list(range(10, 30))  # 5 full blocks
    sched.add("first", system + [1, 2], max_tokens=2)
    run_to_end(sched, runner)
    sched.add("second", system + [3, 4, 5], max_tokens=2)
    out = sched.schedule()
    (chunk,) = out.prefills
    assert chunk.start == 20 and sched.get("second").num_cached_tokens == 20
    sched.update(out, runner.step(sched, out))
    done, _ = run_to_end(sched, runner)
    assert done["second"].output_tokens == reference_output(system + [3, 4, 5], 2)
    assert bm.prefix_hits == 20


def test_randomized_arrivals_and_cancellations_leave_the_pool_as_it_started():
    bm, sched, runner = make(num_blocks=40, block_size=4, max_num_seqs=6, budget=24, max_waiting=10)
    rng = random.Random(11)
    shared = [rng.randrange(90) for _ in range(12)]
    prompts, done, refused, next_id = {}, {}, 0, 0
    for _step in range(1500):
        for _ in range(rng.choice((0, 0, 0, 1, 1, 3))):  # bursts overflow the queue
            p = (shared if rng.random() < 0.5 else []) + [rng.randrange(90) for _ in range(rng.randrange(1, 30))]
            try:
                sched.add(next_id, p, max_tokens=rng.randrange(1, 25))
                prompts[next_id] = p
            except QueueFull:
                refused += 1
            next_id += 1
        if sched._seqs and rng.random() < 0.05:  # cancellations, waiting or running
            victim = rng.choice(list(sched._seqs))
            assert sched.abort(victim)
            done[victim] = None
        out = sched.schedule()
        assert out.num_batched_tokens <= 24 and len(out.chunks) <= 6
        for seq in sched.update(out, runner.step(sched, out)):
            if seq.is_finished:
                done[seq.seq_id] = seq
        bm.check_invariants()
    _, _ = run_to_end(sched, runner)
    finished = [s for s in done.values() if s is not None]
    assert len(finished) > 100 and refused > 0 and bm.prefix_hits > 0
    assert sched.num_preemptions > 0 and bm.evictions > 0
    for seq in finished:
        assert seq.output_tokens == reference_output(prompts[seq.seq_id], seq.max_tokens)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0


def test_a_stop_decided_by_the_engine_ends_the_sequence_and_stats_follow():
    bm, sched, runner = make(num_blocks=16, block_size=4, budget=16)
    sched.add("a", [1, 2, 3, 4, 5], max_tokens=10)
    sched.add("b", [1, 2, 3, 4, 9], max_tokens=10)
    sched.add("c", [7], max_tokens=10)
    out = sched.schedule()
    got = sched.update(out, runner.step(sched, out))
    assert {s.seq_id for s in got} == {"a", "b", "c"}
    st = sched.stats()
    assert st["num_requests_running"] == 3 and st["num_requests_waiting"] == 0
    assert st["kv_blocks_used"] == 2 + 2 + 1 and st["kv_blocks_total"] == 16
    assert st["prefix_cache_queries"] == 11 and st["prefix_cache_hits"] == 0
    assert sched.finish("a", FinishReason.STOP)  # e.g. EOS or a stop string
    assert sched.get("a") is None and not bm.has("a")
    sched.add("d", [1, 2, 3, 4, 6], max_tokens=1)
    sched.schedule()
    st = sched.stats()
    assert st["prefix_cache_hits"] == 4 and st["kv_blocks_cached"] >= 1
    for sid in ("b", "c", "d"):
        sched.abort(sid)
    assert sched.stats()["kv_blocks_used"] == 0 and sched.stats()["num_requests_running"] == 0
