"""python_backends.generation.block_manager: slots, prefix sharing, LRU eviction, no leaks."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from python_backends.generation.block_manager import (
    BlockManager,
    NoFreeBlocks,
    block_hash,
)


def test_slots_follow_the_block_table_and_grow_on_demand():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", [1, 2, 3, 4, 5]) == 0
    table = bm.block_table("a")
    assert len(table) == 2 and bm.num_used_blocks == 2
    assert bm.slots("a", 0, 5) == [table[0] * 4 + i for i in range(4)] + [table[1] * 4]
    # Positions 5..7 fit in the second block; the 9th token needs a third.
    for t in (6, 7, 8):
        bm.append_slot("a", t)
    assert len(bm.block_table("a")) == 2
    slot = bm.append_slot("a", 9)
    table = bm.block_table("a")
    assert len(table) == 3 and slot == table[2] * 4
    with pytest.raises(IndexError):
        bm.slot("a", 9)
    bm.check_invariants()


def test_a_growing_sequence_takes_the_block_after_its_last_when_it_is_clean():
    """Consecutive blocks are what attention reads in place: growth, a rejected draft's block given
    back and taken again, and a neighbour in between keep a lone sequence's table consecutive."""
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.allocate("a", list(range(6)))
    assert bm.block_table("a") == [0, 1]
    bm.allocate("b", [1, 2, 3])  # takes block 2, right after a's
    for t in range(6, 10):
        bm.append_slot("a", t)  # a's third block: 2 is b's, so the oldest clean one
    assert bm.block_table("a") == [0, 1, 3]
    bm.free("b")
    for t in range(10, 13):
        bm.append_slot("a", t)  # a draft runs into a fourth block...
    assert bm.block_table("a") == [0, 1, 3, 4]
    bm.truncate("a", 12)  # ...which is given back
    assert bm.block_table("a") == [0, 1, 3]
    for t in range(12, 21):
        bm.append_slot("a", t)
    assert bm.block_table("a") == [0, 1, 3, 4, 5, 6]
    bm.check_invariants()


def test_a_lone_sequence_copies_its_cached_prefix_into_consecutive_blocks_and_others_share_it():
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(13))  # three full blocks and one token
    bm.allocate("a", prompt)
    bm.mark_computed("a", 13)
    cached = bm.block_table("a")[:3]
    bm.free("a")
    assert bm.take_copies() == []
    # Alone in the pool: the hits are copied, the table is consecutive, the prefill still spared
    assert bm.allocate("b", prompt[:12] + [99, 98]) == 12
    table = bm.block_table("b")
    assert table == list(range(table[0], table[0] + 4)) and not set(table) & set(cached)
    assert bm.take_copies() == [(src, dst, 4) for src, dst in zip(cached, table)]
    assert [bm._refcount[b] for b in cached] == [0, 0, 0] and bm.num_cached_blocks == 3  # still cached, free
    assert bm.prefix_hits == 12
    # Beside a live sequence the hits are shared by reference, nothing copied
    assert bm.allocate("c", prompt[:12] + [7]) == 12
    assert bm.block_table("c")[:3] == cached and bm.take_copies() == []
    bm.mark_computed("b", 14)
    assert bm.num_cached_blocks == 3  # b's copies are private: their keys are already published
    bm.check_invariants()
    for seq in ("b", "c"):
        bm.free(seq)
    assert bm.num_free_blocks == 32
    bm.check_invariants()


def test_free_is_idempotent_and_returns_every_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", [1, 2, 3])
    assert bm.free("a") is True
    assert bm.free("a") is False
    assert bm.free("never-seen") is False
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_pool_exhaustion_is_an_exception_that_leaves_nothing_allocated():
    bm = BlockManager(num_blocks=2, block_size=2)
    assert not bm.can_allocate(5) and bm.can_allocate(4)
    with pytest.raises(NoFreeBlocks):
        bm.allocate("a", [1, 2, 3, 4, 5])
    assert not bm.has("a") and bm.num_free_blocks == 2
    bm.allocate("b", [1, 2, 3, 4])
    assert not bm.can_append_slot("b")
    with pytest.raises(NoFreeBlocks):
        bm.append_slot("b", 5)
    bm.check_invariants()


def test_block_hash_is_chained_and_independent_of_pythonhashseed():
    assert block_hash(None, [1, 2]) != block_hash(block_hash(None, [0, 0]), [1, 2])
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])
    code = (
        "from python_backends.generation.block_manager import block_hash;"
        "print(block_hash(block_hash(None, [5, 6]), [7, 8]).hex())"
    )
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(
            subprocess.run(
                [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True, cwd=os.getcwd()
            ).stdout
        )
    assert outs == {block_hash(block_hash(None, [5, 6]), [7, 8]).hex() + "\n"}


def test_shared_prefix_is_reused_by_refcount_and_counted():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 108))  # two full blocks
    assert bm.allocate("a", system + [1, 2, 3]) == 0
    bm.mark_computed("a", 11)
    assert bm.num_cached_blocks == 2
    assert bm.allocate("b", system + [9]) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]
    assert bm._refcount[bm.block_table("a")[0]] == 2
    assert (bm.prefix_queries, bm.prefix_hits) == (11 + 9, 8)
    bm.check_invariants()
    # A different token before the same block: the chained key must not match.
    assert bm.allocate("c", [0] + system) == 0
    bm.check_invariants()


def test_the_whole_prompt_is_never_reported_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    bm.allocate("a", prompt)
    bm.mark_computed("a", 8)
    # The same 8 tokens: only the first block counts, the last token must run for logits.
    assert bm.allocate("b", prompt) == 4
    assert bm.allocate("c", prompt + [8]) == 8
    bm.check_invariants()


def test_uncomputed_blocks_are_not_shared():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", list(range(9)))
    bm.mark_computed("a", 3)  # first block not fully computed yet
    assert bm.allocate("b", list(range(9))) == 0
    bm.check_invariants()


def test_freed_cached_blocks_stay_cached_until_lru_eviction():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", [1, 2, 3])
    bm.mark_computed("a", 3)
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 1
    # Clean blocks go first: 3 fresh blocks still leave the cached one alone.
    bm.allocate("x", [7, 7, 7, 7, 7, 7])
    assert bm.num_cached_blocks == 1 and bm.evictions == 0
    bm.free("x")
    assert bm.allocate("b", [1, 2, 9]) == 2
    bm.free("b")
    # Now the pool is needed whole: the cached block is evicted and its key forgotten.
    bm.allocate("y", list(range(10, 18)))
    assert bm.num_cached_blocks == 0 and bm.evictions == 1
    bm.free("y")
    assert bm.allocate("c", [1, 2, 9]) == 0
    bm.check_invariants()


def test_eviction_is_least_recently_freed_first_and_tail_before_head():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("old", [1, 2, 3])
    bm.mark_computed("old", 3)
    bm.allocate("new", [5, 6, 7])
    bm.mark_computed("new", 3)
    bm.free("old")
    bm.free("new")
    # Two clean blocks plus one eviction: the older key goes, the newer stays.
    bm.allocate("x", [0] * 6)
    assert bm.evictions == 1
    bm.free("x")
    assert bm.allocate("p", [1, 2, 0]) == 0
    assert bm.allocate("q", [5, 6, 0]) == 2
    # A multi-block prompt: its last full block is evicted before its first.
    head_only = BlockManager(num_blocks=3, block_size=2)
    head_only.allocate("a", [1, 2, 3, 4, 5])
    head_only.mark_computed("a", 5)
    head_only.free("a")
    head_only.allocate("x", [9, 9])
    head_only.allocate("y", [8, 8])
    head_only.free("x")
    head_only.free("y")
    # Head block [1, 2] survived; the tail block [3, 4] was the one evicted.
    assert head_only.allocate("b", [1, 2, 3, 4, 0]) == 2
    head_only.check_invariants()


def test_duplicate_contents_publish_one_key():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", [1, 2, 3])
    bm.allocate("b", [1, 2, 3])  # admitted before a computed anything: no hit
    bm.mark_computed("a", 3)
    bm.mark_computed("b", 3)
    assert bm.num_cached_blocks == 1
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    bm.allocate("a", [1, 2, 3])
    bm.mark_computed("a", 3)
    assert bm.allocate("b", [1, 2, 3]) == 0 and bm.num_cached_blocks == 0


def test_randomized_admit_grow_finish_cancel_keeps_invariants_and_returns_the_pool():
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=48, block_size=4)
    start_free = bm.num_free_blocks
    prefixes = [[rng.randrange(50) for _ in range(rng.choice((4, 8, 12)))] for _ in range(4)]
    live: dict[int, int] = {}  # seq id -> computed tokens
    next_id = 0
    hits = copies = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.35 or not live:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            if bm.can_admit(prompt):
                cached = bm.allocate(next_id, prompt)
                assert cached % 4 == 0 and cached < len(prompt)
                hits += cached > 0
                live[next_id] = cached
                next_id += 1
            else:
                with pytest.raises(NoFreeBlocks):
                    bm.allocate(next_id, prompt)
                assert not bm.has(next_id)
        elif op < 0.42:  # a choice of n forked from a sequence whose tokens are all computed
            sid = rng.choice(list(live))
            bm.mark_computed(sid, bm.num_tokens(sid))
            live[sid] = bm.num_tokens(sid)
            bm.fork(sid, next_id)
            live[next_id] = live[sid]
            next_id += 1
        elif op < 0.8:
            sid = rng.choice(list(live))
            n = bm.num_tokens(sid)
            bm.mark_computed(sid, rng.randint(live[sid], n))
            live[sid] = max(live[sid], bm._seqs[sid].num_computed)
            if bm.can_append_slot(sid):
                slot = bm.append_slot(sid, rng.randrange(50))
                assert slot == bm.slot(sid, n)
                copies += len(bm.take_copies())
            else:
                with pytest.raises(NoFreeBlocks):
                    bm.append_slot(sid, 1)
        else:  # finish, error or cancellation: the same path, sometimes twice
            sid = rng.choice(list(live))
            assert bm.free(sid)
            if rng.random() < 0.3:
                assert not bm.free(sid)
            del live[sid]
        bm.check_invariants()
        # No slot is held by two sequences unless it sits in a shared, computed block.
        owners: dict[int, object] = {}
        for sid in live:
            for pos in range(bm._seqs[sid].num_computed, bm.num_tokens(sid)):
                s = bm.slot(sid, pos)
                assert s not in owners, "two sequences write the same slot"
                owners[s] = sid
    assert hits > 50, "the workload should exercise prefix hits"
    assert bm.forks > 50 and copies > 20, "the workload should exercise forks and copies on write"
    assert bm.evictions > 0, "the workload should exercise eviction"
    for sid in list(live):
        bm.free(sid)
    bm.check_invariants()
    assert bm.num_free_blocks == start_free == 48 and bm.num_used_blocks == 0


def test_a_fork_shares_every_block_and_copies_the_partial_one_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("p", [1, 2, 3, 4, 5, 6])  # one full block, one holding 2 of 4 slots
    bm.mark_computed("p", 6)
    bm.fork("p", "c1")
    bm.fork("p", "c2")
    full, partial = bm.block_table("p")
    assert bm.block_table("c1") == bm.block_table("c2") == [full, partial] and bm.num_used_blocks == 2
    bm.check_invariants()
    # The first two writers into the shared partial block copy it; the last keeps it.
    bm.append_slot("c1", 7)
    new = bm.block_table("c1")[1]
    assert new != partial and bm.take_copies() == [(partial, new, 2)]
    assert bm.slot("c1", 6) == new * 4 + 2 and bm.slot("c1", 5) == new * 4 + 1
    bm.append_slot("c2", 7)
    assert len(bm.take_copies()) == 1
    bm.append_slot("p", 7)
    assert bm.block_table("p") == [full, partial] and bm.take_copies() == []
    assert bm.num_used_blocks == 4
    bm.check_invariants()
    # The full block stays shared until its last holder goes.
    for sid in ("p", "c1", "c2"):
        bm.free(sid)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_a_copy_on_write_needs_a_free_block():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("p", [1, 2, 3, 4, 5])
    bm.mark_computed("p", 5)
    bm.fork("p", "c")
    assert bm.num_free_blocks == 0
    assert not bm.can_append_slot("c") and not bm.can_append_slots("p", 1)
    with pytest.raises(NoFreeBlocks):
        bm.append_slot("c", 6)
    bm.free("c")
    assert bm.can_append_slot("p") and bm.can_append_slots("p", 3) and not bm.can_append_slots("p", 4)
