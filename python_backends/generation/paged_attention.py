"""Paged KV cache and the attention that reads it through block tables.

The pool is preallocated once: per layer one K and one V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence owns a list of
physical block numbers (its block table, handed out by the block manager); token ``i``
of the sequence lives at slot ``block_table[i // block_size] * block_size + i %
block_size``. Blocks need not be contiguous or ordered, which is what lets sequences
grow on demand and share prefix blocks without copying.

Attention reads a group's K/V in one of two ways, chosen per step (:meth:`PagedKVCache.plan`):
where they lie, when the group's rows all read one sequence whose blocks are consecutive in the
pool (a lone stream, its speculative rows, a prompt chunk: every layer's K/V is then a view of the
pool, no copy); else gathered, whole blocks copied by ``index_select`` into a workspace padded to
the group's longest context (a batch of sequences, or a table with gaps). The block manager hands
a growing sequence the block after its last when that one is clean, and a sequence admitted alone
copies its prefix-cache hits ahead of its prompt, so the first case is the common one for a single
stream.

This module holds tensors and does arithmetic only: which blocks a sequence gets, and
when they are freed, is the block manager's business. Everything here runs on whatever
device the pool was created on (CPU in the tests, CUDA on a GPU instance).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Bytes one block costs over all layers, K and V: sizes the pool from a byte budget."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def slots_for_positions(block_table: Sequence[int], positions: Sequence[int] | range, block_size: int) -> list[int]:
    """Physical slots of the given token positions of one sequence.

    Raises IndexError when a position lies beyond the blocks the table holds, so a
    runner that forgot to allocate fails loudly instead of overwriting another sequence.
    """
    slots = []
    for pos in positions:
        block = pos // block_size
        if pos < 0 or block >= len(block_table):
            raise IndexError(f"position {pos} needs block {block}, the table holds {len(block_table)}")
        slots.append(block_table[block] * block_size + pos % block_size)
    return slots


def _as_long(x, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.long)
    return torch.as_tensor(x, dtype=torch.long, device=device)


def pad_block_tables(block_tables: Sequence[Sequence[int]], device=None) -> torch.Tensor:
    """Block tables of unequal length as one [batch, max_blocks] tensor, padded with -1."""
    width = max((len(t) for t in block_tables), default=0)
    out = torch.full((len(block_tables), max(width, 1)), -1, dtype=torch.long)
    for row, table in enumerate(block_tables):
        if len(table):
            out[row, : len(table)] = torch.as_tensor(list(table), dtype=torch.long)
    return out.to(device) if device is not None else out


# What one more attention group costs per layer (a gather, an attention call, their views), in
# padded key rows of work: splitting decodes into buckets pays when it saves more padding than this.
# SmolLM2 on a 2-core AVX-512 EPYC: a padded key row costs about 0.2 us per layer, a group 60-100 us.
GROUP_COST_ROWS = 384


def bucket_by_length(ctx: Sequence[int], group_cost: int = GROUP_COST_ROWS) -> list[list[int]]:
    """Decode rows (indices into ``ctx``) cut into buckets of similar context length.

    A bucket is padded to its longest context, so its work is ``len(bucket) * max``; each bucket
    adds ``group_cost``. The rows are sorted by length and the cuts chosen to minimise the sum
    (an exact dynamic programme over the sorted rows: a batch is at most a few hundred rows).
    Rows keep their order inside a bucket, and a batch of equal lengths stays one bucket.
    """
    n = len(ctx)
    order = sorted(range(n), key=lambda r: ctx[r])
    # Cuts are considered every `stride` rows, so a batch of hundreds costs at most 64^2 / 2 steps.
    stride = -(-n // 64) if n else 1
    points = list(range(0, n, stride)) + [n]
    best = {0: 0.0}  # best[j]: the cheapest cut of the j shortest rows
    cut = {0: 0}
    for pj, j in enumerate(points[1:], 1):
        longest = ctx[order[j - 1]]
        best[j] = math.inf
        for i in points[:pj]:
            cost = best[i] + group_cost + (j - i) * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets = []
    j = n
    while j > 0:
        buckets.append(sorted(order[cut[j] : j]))
        j = cut[j]
    return sorted(buckets, key=lambda rows: rows[0])


class PagedKVCache:
    """The preallocated K/V pool of every layer, and paged attention over it."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attn_dtype: torch.dtype | None = None,
    ):
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # The dtype attention computes in (queries, K/V read back, masks); the pool's by default.
        self.attn_dtype = dtype if attn_dtype is None else attn_dtype
        self.device = torch.device(device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros, not empty: a bug that reads an unwritten slot then gives wrong numbers
        # that a parity test catches, never NaN that poisons a whole softmax row.
        # One tensor for all layers, so a run of blocks is one view across every layer (_PooledKV).
        self._k_pool = torch.zeros(shape, dtype=dtype, device=self.device)
        self._v_pool = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k_cache = list(self._k_pool.unbind(0))
        self.v_cache = list(self._v_pool.unbind(0))
        # Attention groups per step whose K/V were read where they lie, and those gathered.
        self.groups_in_place = 0
        self.groups_gathered = 0
        self._gather_buffers: list[torch.Tensor | None] = [None, None]
        flat = (self.num_slots, num_kv_heads, head_dim)
        self._flat_k = [c.view(flat) for c in self.k_cache]
        self._flat_v = [c.view(flat) for c in self.v_cache]
        # Decode rows are bucketed by context length on a CPU (GROUP_COST_ROWS is a CPU figure); on a
        # GPU each bucket is more kernel launches, so the decodes stay one padded group there.
        self.group_cost: int | None = GROUP_COST_ROWS if self.device.type == "cpu" else None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def nbytes(self) -> int:
        """Bytes the pool holds (K and V, all layers)."""
        return self.num_blocks * bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    def copy_blocks(self, copies) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst`` in every layer, for each
        ``(src, dst, n)``: the block manager's copies on write of forked sequences, and of the prefix
        hits a sequence admitted alone takes as its own (block_manager.py)."""
        for src, dst, n in copies:
            for pool in (self._k_pool, self._v_pool):
                pool[:, dst, :n].copy_(pool[:, src, :n])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping, *, checked: bool = False) -> None:
        """Store new tokens' K and V ([num_tokens, num_kv_heads, head_dim]) at their slots.

        A slot of -1 is skipped: the runner uses it for padding tokens that must not
        land anywhere (vLLM's convention). ``checked``: the caller has verified that every
        slot is in [0, num_slots), so nothing here reads the device back (on CUDA each
        check is a host-device synchronisation, in every layer).
        """
        slots = _as_long(slot_mapping, self.device)
        expected = (slots.numel(), self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"k and v must be {list(expected)}, got {list(k.shape)} and {list(v.shape)}")
        if not checked:
            keep = slots >= 0
            if not bool(keep.all()):
                slots, k, v = slots[keep], k[keep], v[keep]
            if slots.numel() and int(slots.max()) >= self.num_slots:
                raise IndexError(f"slot {int(slots.max())} is beyond the pool's {self.num_slots} slots")
        self.store(layer, k, v, slots)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """:meth:`write` for a caller that has checked everything once per step: ``slots`` a long
        tensor on the pool's device, every slot in [0, num_slots), ``k`` and ``v`` of its shape."""
        self._flat_k[layer].index_copy_(0, slots, k if k.dtype == self.dtype else k.to(self.dtype))
        self._flat_v[layer].index_copy_(0, slots, v if v.dtype == self.dtype else v.to(self.dtype))

    def _workspace(self, which: int, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._gather_buffers[which]
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=self.dtype, device=self.device)
            self._gather_buffers[which] = buf
        return buf[:numel].view(shape)

    def plan(self, block_tables, context_lens, query_lens=None, num_heads: int | None = None) -> AttentionPlan:
        """Everything about one step's attention that does not depend on the layer.

        Built once per step and reused by every layer (masks, padded tables, index maps).
        The batch is split into groups: each prefill chunk is its own, so a 512-token chunk
        beside 31 decodes does not pad every decode row to 512 queries; the decode rows (query
        length 1) of a run are sorted by context length and cut into buckets
        (:func:`bucket_by_length`), so a 900-token context beside 31 of 100 tokens does not pad
        all 32 rows' gather and attention to 900 keys.
        """
        num_heads = self.num_kv_heads if num_heads is None else num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        ctx = [int(c) for c in (context_lens.tolist() if isinstance(context_lens, torch.Tensor) else context_lens)]
        batch = len(ctx)
        if query_lens is None:
            qlen = [1] * batch
        else:
            qlen = [int(c) for c in (query_lens.tolist() if isinstance(query_lens, torch.Tensor) else query_lens)]
        if isinstance(block_tables, torch.Tensor):
            tables_rows = [[int(b) for b in row if b >= 0] for row in block_tables.tolist()]
        else:
            tables_rows = [list(t) for t in block_tables]
        if len(tables_rows) != batch or len(qlen) != batch:
            raise ValueError("block_tables, context_lens and query_lens need one entry per sequence")
        for b in range(batch):
            if qlen[b] < 1 or qlen[b] > ctx[b]:
                raise ValueError("each query_len must be between 1 and its context_len")
            if ctx[b] > len(tables_rows[b]) * self.block_size:
                raise ValueError("a context_len is beyond what its block table can hold")
        group = num_heads // self.num_kv_heads
        groups: list[_Group] = []
        tok = 0
        b = 0
        while b < batch:
            e = b + 1
            if qlen[b] != 1:
                groups.append(self._group(tok, tables_rows[b:e], ctx[b:e], qlen[b:e], group))
                tok += qlen[b]
                b = e
                continue
            while e < batch and qlen[e] == 1:
                e += 1
            # a run of decodes: one token each, so row r of the run is token tok + r
            run = ctx[b:e]
            buckets = [list(range(e - b))] if self.group_cost is None else bucket_by_length(run, self.group_cost)
            for rows in buckets:
                contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
                index = None if contiguous else torch.as_tensor([tok + r for r in rows], device=self.device)
                groups.append(
                    self._group(
                        tok + rows[0],
                        [tables_rows[b + r] for r in rows],
                        [ctx[b + r] for r in rows],
                        [1] * len(rows),
                        group,
                        index,
                    )
                )
            tok += e - b
            b = e
        return AttentionPlan(groups=groups, num_tokens=tok, num_heads=num_heads)

    def _gather_views(self, which: int, blocks: torch.Tensor, batch: int, max_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, seq)``: the workspace as ``index_select``'s target for ``blocks``, and the same
        memory as ``[batch, kv_heads, max_ctx, head_dim]`` (positions past a context are masked).

        Whole blocks are copied with index_select, several times faster on CPU than indexing slot
        by slot. The workspace is reused by every layer and step: fresh tensors of this size cost
        a page fault per 4 KiB on every CPU step (glibc hands them out with mmap), which measured
        slower than the copy itself."""
        out = self._workspace(which, (blocks.numel(), self.block_size, self.num_kv_heads, self.head_dim))
        seq = out.view(batch, -1, self.num_kv_heads, self.head_dim)[:, :max_ctx].transpose(1, 2)
        return out, seq

    def _pooled_views(self, pool: torch.Tensor, first: int, num: int, batch: int, max_ctx: int) -> tuple[torch.Tensor, ...]:
        """Every layer's ``[batch, kv_heads, max_ctx, head_dim]`` view of blocks ``first .. first +
        num - 1`` of ``pool``, the same for each row (stride 0): one unbind for all layers."""
        seq = pool[:, first : first + num].view(self.num_layers, 1, num * self.block_size, self.num_kv_heads, self.head_dim)
        seq = seq[:, :, :max_ctx].transpose(2, 3)
        if batch > 1:
            seq = seq.expand(self.num_layers, batch, self.num_kv_heads, max_ctx, self.head_dim)
        return seq.unbind(0)

    def _read(self, tables: list[list[int]], batch: int, max_ctx: int) -> _GatheredKV | _PooledKV:
        """How a group reads its K/V: in place when every row reads the same consecutive blocks."""
        num = -(-max_ctx // self.block_size)
        first = tables[0][:num]
        if first == list(range(first[0], first[0] + num)) and all(t is tables[0] or t[:num] == first for t in tables[1:]):
            self.groups_in_place += 1
            return _PooledKV(
                self._pooled_views(self._k_pool, first[0], num, batch, max_ctx),
                self._pooled_views(self._v_pool, first[0], num, batch, max_ctx),
            )
        self.groups_gathered += 1
        blocks = pad_block_tables(tables, self.device)[:, :num].clamp_min(0).reshape(-1)
        k_out, k_seq = self._gather_views(0, blocks, batch, max_ctx)
        v_out, v_seq = self._gather_views(1, blocks, batch, max_ctx)
        return _GatheredKV(blocks, k_out, k_seq, v_out, v_seq)

    def _group(self, tok_start, tables, ctx, qlen, group, tok_index=None) -> _Group:
        device = self.device
        batch = len(ctx)
        max_ctx, max_q = max(ctx), max(qlen)
        # One decode row sees every key: SDPA without a mask gives the same numbers, and its flat
        # query already is the padded batch.
        mask = q_row = q_idx = None
        if batch > 1 or max_q > 1:
            ctx_t = torch.as_tensor(ctx, dtype=torch.long, device=device)
            qlen_t = torch.as_tensor(qlen, dtype=torch.long, device=device)
            # Query i of sequence b sits at position ctx - qlen + i and sees keys up to it.
            q_pos = (ctx_t - qlen_t)[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, Qmax]
            k_pos = torch.arange(max_ctx, device=device)
            allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Qmax, L]
            # Padding query rows would be all -inf (NaN out of softmax); let them see key 0
            # and drop them afterwards.
            allowed[:, :, 0] = True
            # Additive (0 / -inf), built once for all layers: a boolean mask is converted to this
            # inside every attention call.
            bias = torch.zeros(allowed.shape, dtype=self.attn_dtype, device=device).masked_fill_(~allowed, float("-inf"))
            mask = bias[:, None, None, :, :].expand(batch, 1, group, max_q, max_ctx)
            mask = mask.reshape(batch, 1, group * max_q, max_ctx)
            if batch > 1 and max_q > 1:  # else the flat queries already are the padded batch
                starts = torch.cumsum(qlen_t, 0) - qlen_t
                # Sizes from the host lists: reading them off a CUDA tensor would synchronise.
                q_row = torch.repeat_interleave(torch.arange(batch, device=device), qlen_t, output_size=sum(qlen))
                q_idx = torch.arange(sum(qlen), device=device) - starts[q_row]
        # Where every layer reads K/V from (views of the pool, or of the workspace the groups share
        # and the gather's block list), made once per step here instead of in every layer.
        kv = self._read(tables, batch, max_ctx)
        return _Group(tok_start, tok_start + sum(qlen), batch, max_q, max_ctx, q_row, q_idx, mask, kv, tok_index)

    def attention_planned(self, layer: int, q: torch.Tensor, plan: AttentionPlan, scale: float | None = None) -> torch.Tensor:
        """Attention of ``q`` ([num_tokens, num_heads, head_dim]) for a prepared plan."""
        num_tokens, num_heads, head_dim = q.shape
        if head_dim != self.head_dim or num_heads != plan.num_heads or num_tokens != plan.num_tokens:
            raise ValueError(
                f"q is [{num_tokens}, {num_heads}, {head_dim}]; the plan is for {plan.num_tokens} "
                f"tokens, {plan.num_heads} heads, head_dim {self.head_dim}"
            )
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        if len(plan.groups) == 1 and plan.groups[0].tok_index is None:
            g = plan.groups[0]
            return self._attend(layer, q if g.tok_end - g.tok_start == num_tokens else q[g.tok_start : g.tok_end], g, scale)
        out = torch.empty_like(q)
        for g in plan.groups:
            if g.tok_index is None:
                out[g.tok_start : g.tok_end] = self._attend(layer, q[g.tok_start : g.tok_end], g, scale)
            else:
                out.index_copy_(0, g.tok_index, self._attend(layer, q.index_select(0, g.tok_index), g, scale))
        return out

    def _attend(self, layer: int, q: torch.Tensor, g: _Group, scale: float) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        k, v = g.kv.read(self, layer)  # [B, Hkv, L, D]
        # K/V are not repeated per query head: the `group` query heads that share KV head j are
        # folded into the query axis instead (head h = j * group + g reads KV head h // group),
        # which saves copying K/V `group` times.
        out_dtype = q.dtype
        if self.attn_dtype != self.dtype:
            k, v = k.to(self.attn_dtype), v.to(self.attn_dtype)
        if q.dtype != self.attn_dtype:
            q = q.to(self.attn_dtype)
        group = num_heads // self.num_kv_heads
        batch, max_q = g.batch, g.max_q
        if max_q == 1:  # decode rows: [B, H, D] is already [B, Hkv, group, D], query axis g
            out = F.scaled_dot_product_attention(
                q.view(batch, self.num_kv_heads, group, head_dim), k, v, attn_mask=g.mask, scale=scale
            )
            out = out.reshape(batch, num_heads, head_dim)
            return out if out.dtype == out_dtype else out.to(out_dtype)
        if g.q_row is None:
            q_pad = q.reshape(batch, max_q, num_heads, head_dim)
        else:
            q_pad = q.new_zeros(batch, max_q, num_heads, head_dim)
            q_pad[g.q_row, g.q_idx] = q
        # -> [B, Hkv, group * Qmax, D], query axis ordered (g, i).
        q_pad = q_pad.view(batch, max_q, self.num_kv_heads, group, head_dim)
        q_pad = q_pad.permute(0, 2, 3, 1, 4).reshape(batch, self.num_kv_heads, group * max_q, head_dim)
        out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=g.mask, scale=scale)
        out = out.view(batch, self.num_kv_heads, group, max_q, head_dim)
        out = out.permute(0, 3, 1, 2, 4).reshape(batch, max_q, num_heads, head_dim)
        if g.q_row is None:
            return out.reshape(batch * max_q, num_heads, head_dim).to(out_dtype)
        return out[g.q_row, g.q_idx].to(out_dtype)

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        block_tables,
        context_lens,
        query_lens=None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Causal grouped-query attention of a batch of sequences through their block tables.

        ``q`` is ``[num_tokens, num_heads, head_dim]``: the query tokens of every
        sequence laid end to end (vLLM's flattened layout), ``query_lens[b]`` of them for
        sequence ``b`` (all 1, the default, is a decode step; more is a prefill chunk).
        ``context_lens[b]`` counts the sequence's tokens including these queries, whose
        K/V must already have been written; its queries are therefore positions
        ``context_lens[b] - query_lens[b] ...  context_lens[b] - 1`` and each attends to
        every earlier position and itself. A chunk may start anywhere, mid-block too.
        Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
        Returns ``[num_tokens, num_heads, head_dim]``. A runner calling every layer builds
        the plan once with :meth:`plan` and calls :meth:`attention_planned`.
        """
        num_tokens, num_heads, head_dim = q.shape
        if head_dim != self.head_dim or num_heads % self.num_kv_heads:
            raise ValueError(
                f"q is [{num_tokens}, {num_heads}, {head_dim}]: heads must be a multiple of "
                f"{self.num_kv_heads} KV heads and head_dim {self.head_dim}"
            )
        plan = self.plan(block_tables, context_lens, query_lens, num_heads)
        if plan.num_tokens != num_tokens:
            raise ValueError(f"query_lens sum to {plan.num_tokens}, q has {num_tokens} tokens")
        return self.attention_planned(layer, q, plan, scale)


@dataclass
class _Group:
    tok_start: int
    tok_end: int
    batch: int
    max_q: int
    max_ctx: int
    q_row: torch.Tensor | None
    q_idx: torch.Tensor | None
    mask: torch.Tensor | None  # None: a single decode row, which sees every key
    kv: _GatheredKV | _PooledKV
    tok_index: torch.Tensor | None = None  # the group's tokens when they are not tok_start..tok_end


@dataclass
class _GatheredKV:
    """K/V copied out of the pool in every layer: the blocks gathered (each table's first
    ceil(max_ctx / block_size), padding read as block 0) and the workspace views they land in
    (PagedKVCache._gather_views)."""

    blocks: torch.Tensor
    k_out: torch.Tensor
    k_seq: torch.Tensor
    v_out: torch.Tensor
    v_seq: torch.Tensor

    def read(self, cache: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.index_select(cache.k_cache[layer], 0, self.blocks, out=self.k_out)
        torch.index_select(cache.v_cache[layer], 0, self.blocks, out=self.v_out)
        return self.k_seq, self.v_seq


@dataclass
class _PooledKV:
    """K/V read where they lie: each layer's view of one sequence's consecutive blocks (PagedKVCache._pooled_views)."""

    k_layers: tuple[torch.Tensor, ...]
    v_layers: tuple[torch.Tensor, ...]

    def read(self, cache: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_layers[layer], self.v_layers[layer]


@dataclass
class AttentionPlan:
    """One step's attention layout, shared by all layers (see :meth:`PagedKVCache.plan`)."""

    groups: list[_Group]
    num_tokens: int
    num_heads: int
