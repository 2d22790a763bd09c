"""The KV block pool: fixed-size blocks, per-sequence block tables and prefix caching.

The pool is preallocated once (the model runner owns the K/V tensors, shaped
``[num_blocks * block_size, ...]``); this module only decides which physical slot each
token of each sequence lives in. That split follows vLLM: the block manager is pure
bookkeeping, so it is tested exhaustively without a model.

Prefix caching: once the K/V of a *full* block has been computed, the block is keyed by
``hash(prev_block_hash, tokens)``. The chain makes the key depend on every token before
the block, because a token's K/V depends on all of them. A new sequence whose prompt
starts with the same full blocks shares them by reference count instead of recomputing
them. A block whose count drops to 0 keeps its contents and its key, and is reused for
other data only when the pool has no clean block left, least recently freed first.

A sequence admitted while it is the only one in the pool (a lone stream) gets private copies
of its cached prefix blocks instead, in fresh blocks consecutive with the rest of its prompt:
its prefill is spared all the same, and attention reads its consecutive blocks in place
(``paged_attention.py``), which a table made of shared blocks followed by fresh ones elsewhere
would not allow. A growing sequence takes the block after its last when that one is clean.

Forks (``n`` > 1 choices of one prompt): :meth:`fork` gives a new sequence the same blocks
by reference. The last, partly filled block is copied on write: the first sequence to add a
token to a shared partial block gets a fresh block and a pending copy of the slots already
written (:meth:`take_copies`; the runner copies them before the step writes anything).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

SeqId = Hashable


class NoFreeBlocks(RuntimeError):
    """The pool cannot give the next block. The scheduler checks first and preempts instead."""


def block_hash(prev_hash: bytes | None, tokens: Iterable[int]) -> bytes:
    """Key of a full block: its tokens chained with the key of everything before it.

    blake2b over the tokens as int64 bytes, so keys are stable across processes and do
    not depend on PYTHONHASHSEED (Python's ``hash`` of a tuple does).
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(prev_hash if prev_hash is not None else b"\x00" * 16)
    h.update(np.asarray(list(tokens), dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class _SeqBlocks:
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    # Keys of the leading full blocks whose K/V are computed (published or not).
    hashes: list[bytes] = field(default_factory=list)
    num_computed: int = 0


class BlockManager:
    """Allocates KV slots to sequences out of ``num_blocks`` blocks of ``block_size`` tokens.

    The scheduler calls :meth:`can_admit` / :meth:`allocate` on admission,
    :meth:`can_append_slot` / :meth:`append_slot` before each decode,
    :meth:`mark_computed` after each step (that is when full blocks become shareable),
    and :meth:`free` exactly once per finished, failed, cancelled or preempted sequence
    (calling it again is harmless). The runner reads :meth:`block_table` and :meth:`slots`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        # Blocks with count 0 and no key: handed out first (oldest first), so cached contents live longer.
        self._clean: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Blocks with count 0 that still hold a key, oldest first (LRU eviction order).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        self._seqs: dict[SeqId, _SeqBlocks] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found cached
        self.evictions = 0
        self.forks = 0
        # (source block, destination block, slots to copy) of copies on write, for the next step.
        self._copies: list[tuple[int, int, int]] = []

    # ---- counters -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (clean or cached-evictable): what can still be allocated."""
        return len(self._clean) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a prefix key, held or not."""
        return len(self._cached)

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_tokens: int) -> bool:
        """Whether ``n_tokens`` fresh slots fit in the pool, ignoring prefix hits."""
        return self.blocks_needed(n_tokens) <= self.num_free_blocks

    # ---- prefix lookup ----------------------------------------------------------------
    def _hits(self, tokens: Sequence[int], use_cache: bool = True) -> tuple[list[int], list[bytes]]:
        """Longest run of cached full blocks at the start of ``tokens`` (none without ``use_cache``).

        At most ``(len - 1) // block_size`` blocks: the last token must always be computed,
        because its logits give the next token.
        """
        if not self.enable_prefix_caching or not use_cache:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[bytes] = []
        prev = None
        for i in range((len(tokens) - 1) // bs):
            h = block_hash(prev, tokens[i * bs : (i + 1) * bs])
            b = self._cached.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            prev = h
        return blocks, hashes

    def can_admit(self, tokens: Sequence[int], use_cache: bool = True) -> bool:
        """Whether a sequence with these prompt tokens can be allocated now, prefix hits counted."""
        hits, _ = self._hits(tokens, use_cache)
        # A hit on a block nobody holds takes it off the free list too.
        idle_hits = sum(1 for b in hits if self._refcount[b] == 0)
        need = self.blocks_needed(len(tokens)) - len(hits)
        return need <= self.num_free_blocks - idle_hits

    # ---- allocation --------------------------------------------------------------------
    def _take_block(self, after: int | None = None) -> int:
        """A free block: the one after block ``after`` when it is clean (a sequence that grows into
        consecutive blocks is read by attention where it lies, paged_attention.py), else the oldest
        clean block, else the least recently freed cached block."""
        if after is not None and after + 1 in self._clean:
            b = after + 1
            del self._clean[b]
        elif self._clean:
            b, _ = self._clean.popitem(last=False)
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            h = self._hash_of[b]
            assert h is not None  # an evictable block has a key
            del self._cached[h]
            self._hash_of[b] = None
            self.evictions += 1
        else:
            raise NoFreeBlocks(f"all {self.num_blocks} KV blocks are in use")
        self._refcount[b] = 1
        return b

    def _append_block(self, s: _SeqBlocks) -> None:
        """Give the sequence one more block, the one after its last when that one is clean."""
        s.blocks.append(self._take_block(s.blocks[-1] if s.blocks else None))

    def _hold(self, b: int) -> None:
        if self._refcount[b] == 0:
            del self._evictable[b]
        self._refcount[b] += 1

    def allocate(self, seq_id: SeqId, tokens: Sequence[int], use_cache: bool = True) -> int:
        """Give a new sequence slots for all its prompt ``tokens``; return how many are cached.

        The returned count is a multiple of ``block_size`` and always below ``len(tokens)``:
        prefill starts at that position. Raises NoFreeBlocks (leaving nothing allocated)
        when the pool is short; check :meth:`can_admit` first. Without ``use_cache`` no
        prefix is reused (every token is computed; its full blocks are still published).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if not tokens:
            raise ValueError("a sequence needs at least one token")
        if not self.can_admit(tokens, use_cache):
            raise NoFreeBlocks(f"{self.blocks_needed(len(tokens))} blocks needed, {self.num_free_blocks} free")
        hits, hashes = self._hits(tokens, use_cache)
        state = _SeqBlocks(tokens=list(tokens), hashes=list(hashes))
        state.num_computed = len(hits) * self.block_size
        # A lone sequence (the only one the pool holds) copies its cached prefix into fresh blocks
        # ahead of the rest of its prompt instead of sharing it: its table is then consecutive and
        # attention reads it in place every step (paged_attention.py). The copies run before the step
        # writes anything, in the order queued, so the cached blocks they read are intact even if
        # this step's allocations hand them out again.
        copy_hits = bool(hits) and not self._seqs and self.blocks_needed(len(tokens)) <= len(self._clean)
        if not copy_hits:
            for b in hits:
                self._hold(b)
            state.blocks = list(hits)
        while len(state.blocks) < self.blocks_needed(len(tokens)):
            self._append_block(state)
        if copy_hits:
            self._copies += [(src, dst, self.block_size) for src, dst in zip(hits, state.blocks)]
        self._seqs[seq_id] = state
        self.prefix_queries += len(tokens)
        self.prefix_hits += state.num_computed
        return state.num_computed

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """Give ``child`` the blocks, tokens and computed state of ``parent``, by reference."""
        if child in self._seqs:
            raise ValueError(f"sequence {child!r} already has blocks")
        p = self._seqs[parent]
        for b in p.blocks:
            self._hold(b)
        self._seqs[child] = _SeqBlocks(list(p.blocks), list(p.tokens), list(p.hashes), p.num_computed)
        self.forks += 1

    def _needed(self, s: _SeqBlocks, n: int) -> int:
        """Fresh blocks ``n`` more tokens of the sequence take: its last block's room first,
        after a copy of that block when it is shared."""
        room = len(s.blocks) * self.block_size - len(s.tokens)
        copy = 1 if n > 0 and room > 0 and self._refcount[s.blocks[-1]] > 1 else 0
        return copy + self.blocks_needed(max(0, n - room))

    def can_append_slot(self, seq_id: SeqId) -> bool:
        """Whether the next token of this sequence gets a slot: room in its own last block, or a free block."""
        return self._needed(self._seqs[seq_id], 1) <= self.num_free_blocks

    def can_append_slots(self, seq_id: SeqId, n: int) -> bool:
        """Whether ``n`` more tokens of this sequence get slots (its last block's room, then free blocks)."""
        return self._needed(self._seqs[seq_id], n) <= self.num_free_blocks

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The copies on write made since the last call: (source, destination, slots) each."""
        copies, self._copies = self._copies, []
        return copies

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Drop the sequence's tokens after the first ``num_tokens`` (a rejected speculative draft).

        Only tokens whose K/V were not marked computed can go, so no published block changes;
        blocks left empty go back to the clean list.
        """
        s = self._seqs[seq_id]
        if not s.num_computed <= num_tokens <= len(s.tokens):
            raise ValueError(f"truncate {seq_id!r} to {num_tokens}: it has {len(s.tokens)} tokens, {s.num_computed} computed")
        del s.tokens[num_tokens:]
        while len(s.blocks) > self.blocks_needed(len(s.tokens)):
            b = s.blocks.pop()
            assert self._refcount[b] == 1 and self._hash_of[b] is None, "a draft's block was shared"
            self._refcount[b] = 0
            self._clean[b] = None

    def append_slot(self, seq_id: SeqId, token: int) -> int:
        """Add ``token`` to the sequence and return the physical slot its K/V go to."""
        s = self._seqs[seq_id]
        if len(s.tokens) == len(s.blocks) * self.block_size:
            self._append_block(s)
        elif self._refcount[s.blocks[-1]] > 1:  # a shared partial block: copy on write
            shared = s.blocks[-1]
            s.blocks[-1] = self._take_block()
            self._refcount[shared] -= 1
            self._copies.append((shared, s.blocks[-1], len(s.tokens) % self.block_size))
        s.tokens.append(int(token))
        return self.slot(seq_id, len(s.tokens) - 1)

    def mark_computed(self, seq_id: SeqId, num_computed: int) -> None:
        """The runner wrote K/V for the first ``num_computed`` tokens: publish full blocks.

        A block joins the prefix cache only now, once its contents are real. If another
        sequence already published the same key, this block stays private (no duplicates).
        """
        s = self._seqs[seq_id]
        if num_computed > len(s.tokens):
            raise ValueError(f"{num_computed} computed > {len(s.tokens)} tokens of {seq_id!r}")
        s.num_computed = max(s.num_computed, num_computed)
        bs = self.block_size
        while (len(s.hashes) + 1) * bs <= s.num_computed:
            i = len(s.hashes)
            prev = s.hashes[-1] if s.hashes else None
            h = block_hash(prev, s.tokens[i * bs : (i + 1) * bs])
            s.hashes.append(h)
            b = s.blocks[i]
            if self.enable_prefix_caching and h not in self._cached and self._hash_of[b] is None:
                self._cached[h] = b
                self._hash_of[b] = h

    def free(self, seq_id: SeqId) -> bool:
        """Release the sequence's blocks; idempotent. Returns whether it held any.

        Blocks are released last first, so under LRU the tail of a prompt is evicted
        before its head (the head is the part other prompts are likeliest to share).
        """
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return False
        for b in reversed(s.blocks):
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                if self._hash_of[b] is not None:
                    self._evictable[b] = None
                else:
                    self._clean[b] = None
        return True

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` carries a prefix key (its contents may be reused by a later prompt)."""
        return self._hash_of[block] is not None

    def uncache(self, block: int) -> None:
        """Forget ``block``'s prefix key: its contents can no longer be shared (a runner that cannot keep
        them any more says so). A block nobody holds goes back to the clean list."""
        h = self._hash_of[block]
        if h is None:
            return
        del self._cached[h]
        self._hash_of[block] = None
        if self._refcount[block] == 0:
            del self._evictable[block]
            self._clean[block] = None

    # ---- what the runner reads ----------------------------------------------------------
    def has(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id: SeqId) -> int:
        """Tokens of the sequence that have a slot."""
        return len(self._seqs[seq_id].tokens)

    def block_table(self, seq_id: SeqId) -> list[int]:
        return list(self._seqs[seq_id].blocks)

    def slot(self, seq_id: SeqId, position: int) -> int:
        """Physical slot (``block * block_size + offset``) of the token at ``position``."""
        s = self._seqs[seq_id]
        if not 0 <= position < len(s.tokens):
            raise IndexError(f"position {position} outside 0..{len(s.tokens) - 1} of {seq_id!r}")
        return s.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Slots of positions ``start..end-1`` (the runner's slot mapping for one chunk)."""
        return [self.slot(seq_id, p) for p in range(start, end)]

    # ---- invariants (tests and debugging) ----------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        holders = [0] * self.num_blocks
        for s in self._seqs.values():
            assert len(s.blocks) == self.blocks_needed(len(s.tokens)), "table size != tokens"
            assert len(set(s.blocks)) == len(s.blocks), "a block twice in one table"
            for b in s.blocks:
                holders[b] += 1
        assert holders == self._refcount, "refcounts differ from the tables holding blocks"
        free = list(self._clean) + list(self._evictable)
        assert len(free) == len(set(free)), "a block twice on the free lists"
        for b in free:
            assert self._refcount[b] == 0, f"block {b} is free and referenced"
        assert len(free) + sum(1 for c in self._refcount if c > 0) == self.num_blocks, "lost blocks"
        for b in self._clean:
            assert self._hash_of[b] is None, f"clean block {b} carries a key"
        for b in self._evictable:
            assert self._hash_of[b] is not None, f"evictable block {b} has no key"
        for h, b in self._cached.items():
            assert self._hash_of[b] == h, "cache map and block keys disagree"
        assert sum(1 for h in self._hash_of if h is not None) == len(self._cached)
