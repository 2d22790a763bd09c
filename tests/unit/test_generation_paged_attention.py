"""Paged attention against dense causal attention over the same K/V (FP32, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from python_backends.generation.paged_attention import (
    PagedKVCache,
    bucket_by_length,
    bytes_per_block,
    pad_block_tables,
    slots_for_positions,
)

# SmolLM2-135M's attention shape; two layers are enough to check layers stay apart.
HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def dense_causal(q, k, v, start):
    """Reference: query i (position start + i) attends to keys 0..start+i, GQA by h // group."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // group], v[:, h // group]
        scores = q[:, h] @ kh.T / math.sqrt(q.shape[-1])  # [Q, L]
        pos_q = start + torch.arange(q.shape[0])[:, None]
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos_q, float("-inf"))
        out[:, h] = torch.softmax(scores, -1) @ vh
    return out


def make_cache(num_blocks=64, layers=2):
    return PagedKVCache(layers, num_blocks, BLOCK, KV_HEADS, DIM)


def shuffled_tables(lengths, num_blocks, gen):
    """Disjoint, non-contiguous, shuffled block tables covering each length."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(perm[:need])
        perm = perm[need:]
    return tables


def fill(cache, layer, tables, lengths, gen):
    """Write random K/V for every position of every sequence; return the dense copies."""
    dense = []
    for table, n in zip(tables, lengths):
        k = torch.randn(n, KV_HEADS, DIM, generator=gen)
        v = torch.randn(n, KV_HEADS, DIM, generator=gen)
        cache.write(layer, k, v, slots_for_positions(table, range(n), BLOCK))
        dense.append((k, v))
    return dense


def test_decode_batch_mixed_lengths_matches_dense():
    gen = torch.Generator().manual_seed(0)
    cache = make_cache()
    lengths = [1, 15, 16, 17, 40, 100, 3]
    tables = shuffled_tables(lengths, cache.num_blocks, gen)
    assert any(t != sorted(t) or t != list(range(t[0], t[0] + len(t))) for t in tables if len(t) > 1)
    dense = fill(cache, 1, tables, lengths, gen)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen)
    out = cache.attention(1, q, tables, lengths)
    assert out.shape == q.shape
    for b, ((k, v), n) in enumerate(zip(dense, lengths)):
        ref = dense_causal(q[b : b + 1], k, v, start=n - 1)
        assert (out[b : b + 1] - ref).abs().max().item() < 1e-5


def test_bucket_by_length_cuts_where_padding_costs_more_than_a_group():
    assert bucket_by_length([100] * 8) == [list(range(8))]  # equal lengths: one bucket
    assert bucket_by_length([10, 20, 30], group_cost=10**6) == [[0, 1, 2]]  # groups too dear to split
    assert bucket_by_length([10, 20, 30], group_cost=0) == [[0], [1], [2]]
    # two long contexts among many short ones get a bucket of their own; rows keep their order
    lengths = [900, 40, 50, 60, 880] + [30] * 27
    buckets = bucket_by_length(lengths, group_cost=384)
    assert sorted(r for b in buckets for r in b) == list(range(len(lengths)))
    assert [0, 4] in buckets
    assert all(b == sorted(b) for b in buckets)
    padded = sum(len(b) * max(lengths[r] for r in b) for b in buckets)
    assert padded + 384 * len(buckets) < 900 * len(lengths) + 384


def test_decode_buckets_out_of_order_match_dense_and_one_group():
    """Decode rows whose buckets interleave (long, short, long, short...): each row gets its own
    sequence's attention, the numbers the one padded group gives up to the last bits (the attention
    kernel's blocks over the keys depend on the padded length)."""
    gen = torch.Generator().manual_seed(3)
    cache = make_cache(num_blocks=256)
    lengths = [700, 20, 33, 650, 18, 25, 690, 31]
    tables = shuffled_tables(lengths, cache.num_blocks, gen)
    dense = fill(cache, 0, tables, lengths, gen)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen)
    plan = cache.plan(tables, lengths, num_heads=HEADS)
    assert len(plan.groups) >= 2 and any(g.tok_index is not None for g in plan.groups)
    out = cache.attention_planned(0, q, plan)
    for b, ((k, v), n) in enumerate(zip(dense, lengths)):
        ref = dense_causal(q[b : b + 1], k, v, start=n - 1)
        assert (out[b : b + 1] - ref).abs().max().item() < 1e-5
    one_group = cache._group(0, tables, lengths, [1] * len(lengths), HEADS // KV_HEADS)
    one_plan = type(plan)(groups=[one_group], num_tokens=len(lengths), num_heads=HEADS)
    assert (out - cache.attention_planned(0, q, one_plan)).abs().max().item() < 1e-6


def test_prefill_chunks_mixed_with_decode_rows():
    """A chunk starting mid-block, a whole prompt and decode rows in one call."""
    gen = torch.Generator().manual_seed(1)
    cache = make_cache()
    lengths = [50, 23, 9, 64]
    query_lens = [13, 23, 1, 1]  # seq 0: positions 37..49 (block 2 offset 5 onward)
    tables = shuffled_tables(lengths, cache.num_blocks, gen)
    dense = fill(cache, 0, tables, lengths, gen)
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=gen)
    out = cache.attention(0, q, pad_block_tables(tables), torch.tensor(lengths), query_lens)
    start = 0
    for (k, v), n, ql in zip(dense, lengths, query_lens):
        ref = dense_causal(q[start : start + ql], k, v, start=n - ql)
        assert (out[start : start + ql] - ref).abs().max().item() < 1e-5
        start += ql


def test_chunked_prefill_equals_one_shot_prefill():
    """Writing a prompt in three chunks and attending chunk by chunk gives one-shot numbers."""
    gen = torch.Generator().manual_seed(2)
    cache = make_cache()
    n = 45
    table = shuffled_tables([n], cache.num_blocks, gen)[0]
    k = torch.randn(n, KV_HEADS, DIM, generator=gen)
    v = torch.randn(n, KV_HEADS, DIM, generator=gen)
    q = torch.randn(n, HEADS, DIM, generator=gen)
    pieces = []
    for lo, hi in ((0, 7), (7, 30), (30, 45)):
        cache.write(0, k[lo:hi], v[lo:hi], slots_for_positions(table, range(lo, hi), BLOCK))
        pieces.append(cache.attention(0, q[lo:hi], [table], [hi], [hi - lo]))
    ref = dense_causal(q, k, v, start=0)
    assert (torch.cat(pieces) - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "lengths, query_lens",
    [
        ([37], [1]),  # a lone decode row
        ([40, 41, 42, 43], [1, 1, 1, 1]),  # one sequence's speculative rows: same table, one position each
        ([45], [12]),  # a prompt chunk starting mid-block
        ([16], [16]),  # a whole prompt, exactly one block
    ],
)
def test_consecutive_blocks_are_read_in_place_with_the_gathered_numbers(lengths, query_lens):
    """A group reading one sequence's consecutive blocks attends to views of the pool, bit for bit
    what the gather gives for the same K/V in scattered blocks, and within float error of dense."""
    gen = torch.Generator().manual_seed(7)
    n = max(lengths)
    k = torch.randn(n, KV_HEADS, DIM, generator=gen)
    v = torch.randn(n, KV_HEADS, DIM, generator=gen)
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=gen)
    outs = []
    for table in (list(range(5, 5 + -(-n // BLOCK))), shuffled_tables([n], 64, gen)[0]):
        cache = make_cache()
        cache.write(1, k, v, slots_for_positions(table, range(n), BLOCK))
        outs.append(cache.attention(1, q, [table] * len(lengths), lengths, query_lens))
        consecutive = table == list(range(table[0], table[0] + len(table)))
        assert (cache.groups_in_place, cache.groups_gathered) == ((1, 0) if consecutive else (0, 1))
    assert torch.equal(outs[0], outs[1])
    start = 0
    for length, ql in zip(lengths, query_lens):
        ref = dense_causal(q[start : start + ql], k[:length], v[:length], start=length - ql)
        assert (outs[0][start : start + ql] - ref).abs().max().item() < 1e-5
        start += ql


def test_rows_of_different_sequences_are_gathered_even_when_each_is_consecutive():
    gen = torch.Generator().manual_seed(8)
    cache = make_cache()
    tables = [[0, 1], [2, 3]]
    dense = fill(cache, 0, tables, [20, 30], gen)
    q = torch.randn(2, HEADS, DIM, generator=gen)
    out = cache.attention(0, q, tables, [20, 30])
    assert (cache.groups_in_place, cache.groups_gathered) == (0, 1)
    for b, ((kk, vv), n) in enumerate(zip(dense, [20, 30])):
        assert (out[b : b + 1] - dense_causal(q[b : b + 1], kk, vv, start=n - 1)).abs().max().item() < 1e-5


def test_layers_and_sequences_do_not_leak_into_each_other():
    gen = torch.Generator().manual_seed(3)
    cache = make_cache()
    tables = shuffled_tables([20, 20], cache.num_blocks, gen)
    dense0 = fill(cache, 0, tables, [20, 20], gen)
    fill(cache, 1, tables, [20, 20], gen)  # other layer, same slots: must not disturb layer 0
    q = torch.randn(2, HEADS, DIM, generator=gen)
    out = cache.attention(0, q, tables, [20, 20])
    for b in range(2):
        ref = dense_causal(q[b : b + 1], *dense0[b], start=19)
        assert (out[b : b + 1] - ref).abs().max().item() < 1e-5
    # Changing sequence 1's K changes only its own output.
    cache.write(0, torch.randn(1, KV_HEADS, DIM), torch.randn(1, KV_HEADS, DIM), slots_for_positions(tables[1], [5], BLOCK))
    out2 = cache.attention(0, q, tables, [20, 20])
    assert torch.equal(out2[0], out[0])
    assert not torch.allclose(out2[1], out[1])


def test_write_skips_padding_slots_and_refuses_bad_shapes():
    cache = make_cache(num_blocks=4, layers=1)
    k = torch.ones(2, KV_HEADS, DIM)
    cache.write(0, k, k, [3, -1])
    assert cache.k_cache[0].view(-1, KV_HEADS, DIM)[3].eq(1).all()
    assert cache.k_cache[0].sum().item() == KV_HEADS * DIM
    with pytest.raises(ValueError, match="k and v must be"):
        cache.write(0, torch.ones(2, KV_HEADS + 1, DIM), k, [0, 1])
    with pytest.raises(IndexError, match="beyond the pool"):
        cache.write(0, k, k, [0, 4 * BLOCK])
    with pytest.raises(IndexError, match="needs block 1"):
        slots_for_positions([2], [BLOCK], BLOCK)
    with pytest.raises(ValueError, match="query_lens sum"):
        cache.attention(0, torch.ones(3, HEADS, DIM), [[0]], [4], [2])
    with pytest.raises(ValueError, match="beyond what its block table"):
        cache.attention(0, torch.ones(1, HEADS, DIM), [[0]], [BLOCK + 1])


def test_sizes():
    cache = PagedKVCache(30, 10, BLOCK, KV_HEADS, DIM)
    # SmolLM2-135M, FP32: 2 (K,V) x 30 layers x 16 tokens x 3 heads x 64 x 4 bytes.
    assert bytes_per_block(30, BLOCK, KV_HEADS, DIM) == 2 * 30 * 16 * 3 * 64 * 4 == 737280
    assert cache.nbytes() == 10 * 737280 == sum(t.nbytes for t in cache.k_cache + cache.v_cache)
    assert bytes_per_block(30, BLOCK, KV_HEADS, DIM, torch.bfloat16) == 737280 // 2


@pytest.mark.gpu
def test_paged_attention_on_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the same code path runs on the CPU in the tests above")
    gen = torch.Generator().manual_seed(4)
    lengths, qlens = [33, 5], [3, 1]
    tables = shuffled_tables(lengths, 16, gen)
    caches = [PagedKVCache(1, 16, BLOCK, KV_HEADS, DIM, device=d) for d in ("cpu", "cuda")]
    ks = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
    q = torch.randn(sum(qlens), HEADS, DIM, generator=gen)
    outs = []
    for cache in caches:
        for table, n, k in zip(tables, lengths, ks):
            cache.write(0, k.to(cache.device), k.to(cache.device), slots_for_positions(table, range(n), BLOCK))
        outs.append(cache.attention(0, q.to(cache.device), tables, lengths, qlens).cpu())
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4
