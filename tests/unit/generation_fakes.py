"""A fake model for the scheduler's tests: K/V kept per slot, tokens a fixed function of the context.

It writes each chunk's tokens into a fake KV store at the planned slots, reads every context
back through the block table (a wrong slot, a wrongly shared prefix block or a wrong recompute
fails the read-back; block copies are made first, as the runner makes them), and "samples" ``next_token(context)`` for each row that samples. A chunk
with a prompt-lookup draft yields what the engine keeps of it (``accept_draft``).
"""

from __future__ import annotations

from collections.abc import Callable

from python_backends.generation.block_manager import BlockManager
from python_backends.generation.scheduler import Scheduler
from python_backends.generation.speculative import accept_draft


class FakeRunner:
    def __init__(self, bm: BlockManager, next_token: Callable[[list[int]], int]):
        self.bm = bm
        self.next_token = next_token
        self.kv: dict[int, int] = {}
        self.drafted = self.accepted = 0

    def step(self, sched: Scheduler, out) -> dict:
        sampled = {}
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        bs = self.bm.block_size
        for src, dst, n in out.copies:  # before anything is written, as the runner does
            for i in range(n):
                if src * bs + i in self.kv:
                    self.kv[dst * bs + i] = self.kv[src * bs + i]
        for c in out.chunks:
            assert len(c.token_ids) == len(c.slots) == c.end - c.start
            for slot, tok in zip(c.slots, c.token_ids):
                self.kv[slot] = tok
            context = [self.kv[c.block_table[p // bs] * bs + p % bs] for p in range(c.end)]
            assert context == (sched.get(c.seq_id).tokens + c.draft)[: c.end], "K/V read back wrong"
            if not c.samples:
                continue
            rows = [self.next_token(context[: c.end - c.num_logits + 1 + j]) for j in range(c.num_logits)]
            if c.draft:
                sampled[c.seq_id] = accept_draft(c.draft, rows)
                self.drafted += len(c.draft)
                self.accepted += len(sampled[c.seq_id]) - 1
            else:
                sampled[c.seq_id] = rows[0]
        return sampled
