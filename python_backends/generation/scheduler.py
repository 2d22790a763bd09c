"""Continuous batching: which sequences run in the next engine step, and how many tokens each.

No model calls here. One engine loop calls :meth:`Scheduler.schedule`, runs one batched
forward over the returned plan, samples a token for every entry whose ``samples`` is
true and hands them back with :meth:`Scheduler.update`. New requests join between steps.

The policy follows vLLM's: under a per-step token budget, every running decode gets its
one token first, so streams never stall; what is left goes to prefill, in chunks, so a
long prompt is split across steps instead of blocking everyone for its whole length.
When the pool cannot give a running sequence its next slot, the most recently admitted
running sequence is preempted by recompute: its blocks are freed and it goes back to the
front of the queue with its generated tokens appended to what must be recomputed (on
resume the prefix cache usually finds its prompt blocks still there).

Each sequence has a priority class (0 interactive, 1 default, 2 bulk: contract.sampling's
PRIORITY_CLASSES). Waiting sequences queue per class, admitted highest class first (FIFO
within one); the running list is kept in (class, admission) order, so decodes and prefills
serve the higher classes first and the sequence preempted is the newest of the lowest class.
``max_running_bulk`` caps the places bulk sequences take, leaving room for the other classes.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from contract.errors import CONTEXT_LENGTH, InputError, Overloaded
from contract.sampling import PRIORITY_CLASSES
from python_backends.generation.block_manager import BlockManager
from python_backends.generation.speculative import propose_ngram

SeqId = Hashable
NUM_CLASSES = len(PRIORITY_CLASSES)
DEFAULT_CLASS = PRIORITY_CLASSES.index("default")
BULK = PRIORITY_CLASSES.index("bulk")


class QueueFull(Overloaded):
    """The waiting queue is at ``max_waiting``: refuse the request now (Triton UNAVAILABLE)."""

    def __init__(self, waiting: int, max_num_seqs: int, max_waiting: int):
        super().__init__(
            f"{waiting} requests already waiting and the running batch is full "
            f"(max_num_seqs={max_num_seqs}, max_waiting={max_waiting})",
            values={"waiting": waiting, "max_num_seqs": max_num_seqs, "max_waiting": max_waiting},
        )


class ContextTooLong(InputError):
    """prompt + max_tokens exceed the context, or the KV pool (Triton INVALID_ARG)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int, pool: bool = False):
        total = prompt_tokens + max_tokens
        where = f"the KV pool holds {limit - 1} tokens" if pool else f"the context limit of {limit} tokens"
        super().__init__(
            "max_tokens",
            f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}: {total} exceeds {where}",
            code=CONTEXT_LENGTH,
            values={"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "limit": limit},
        )


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # EOS or a stop string, decided by the caller
    ABORT = "abort"  # cancelled by the client or failed


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it. ``tokens`` = prompt + generated so far."""

    seq_id: SeqId
    prompt_tokens: list[int]
    max_tokens: int
    arrival: int
    output_tokens: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are in the cache; the rest (at least one) still have to run.
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache at the latest admission.
    num_cached_tokens: int = 0
    # Tokens to prefill since the latest admission: the prompt, plus the generated
    # tokens after a preemption (recompute). Beyond them the sequence decodes.
    num_prefill_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # Its decodes may carry a prompt-lookup draft (greedy requests: the engine decides).
    speculative: bool = False
    # Tokens the latest update appended to output_tokens (more than one after an accepted draft).
    num_new_tokens: int = 0
    # Sequences still to be forked from this one when its prompt is computed (n > 1 choices):
    # they hold places in the running batch from its admission on.
    num_forks: int = 0
    # A continued stream (output tokens given at admission): after its prompt, at most this many of
    # them per step (0: with the prompt), so their K/V come from steps shaped as the decodes that
    # generated them (Scheduler.replay_rows). Cleared by a preemption.
    replay_rows: int = 0
    # Its prompt's log-probabilities are asked for: admitted without prefix-cache hits, and its
    # prefill chunks return every row's logits. The engine clears it once it has them all.
    prompt_rows: bool = False
    # Its priority class: 0 interactive, 1 default, 2 bulk (admitted in that order, preempted in the reverse).
    priority: int = DEFAULT_CLASS

    @property
    def tokens(self) -> list[int]:
        return self.prompt_tokens + self.output_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.output_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class ScheduledChunk:
    """Run ``token_ids`` (positions ``start..end-1``) of one sequence this step.

    ``slots`` is where the runner writes their K/V; attention reads positions
    ``0..end-1`` through ``block_table``. ``samples``: the chunk reaches the end of the
    sequence, so the logits of its last position give the next token. A decode with a
    ``draft`` runs the last sampled token and the draft's tokens; every row samples.
    """

    seq_id: SeqId
    start: int
    end: int
    token_ids: list[int]
    slots: list[int]
    block_table: list[int]
    is_prefill: bool
    samples: bool
    draft: list[int] = field(default_factory=list)
    # A prefill chunk of a sequence whose prompt log-probabilities are asked for: every row's logits.
    prompt_rows: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_samples(self) -> int:
        """Rows at the chunk's end whose logits the step samples."""
        return 1 + len(self.draft) if self.samples else 0

    @property
    def num_logits(self) -> int:
        """Rows whose logits the runner returns: the sampled ones at the chunk's end, or every row."""
        return self.num_tokens if self.prompt_rows else self.num_samples


@dataclass
class SchedulerOutput:
    """One step's plan: decodes first (one token each), then prefill chunks."""

    decodes: list[ScheduledChunk]
    prefills: list[ScheduledChunk]
    preempted: list[SeqId]
    # Block copies (source, destination, slots) the runner makes before the step: copies on write of
    # forked sequences, and prefix hits copied for a sequence admitted alone (block_manager.py).
    copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Admission, chunked prefill, decode batching, preemption and abort over a BlockManager."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_waiting: int,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        speculative_max_seqs: int = 0,
        prefill_tokens_with_decodes: int = 0,
        max_running_bulk: int = 0,
    ):
        if max_num_seqs <= 0 or max_waiting < 0 or max_model_len <= 0:
            raise ValueError("max_num_seqs and max_model_len must be > 0, max_waiting >= 0")
        if max_num_batched_tokens < max_num_seqs:
            # Otherwise some running decode would get no token in a full step.
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs})")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.max_model_len = max_model_len
        # Prompt-lookup drafts of up to this many tokens, while at most speculative_max_seqs
        # sequences decode (above that the rows cost real compute: no draft).
        self.num_speculative_tokens = num_speculative_tokens
        self.speculative_max_seqs = speculative_max_seqs
        # A step that carries decodes spends at most this many tokens on prompts (0: the whole
        # budget): a long prompt then takes more, shorter steps, and running streams' tokens are
        # not held up by a full 256-token chunk.
        self.prefill_tokens_with_decodes = prefill_tokens_with_decodes
        # A runtime whose steps of few rows compute otherwise than its prefills (other weights:
        # ov_int4_f16) sets this: a continued stream's given tokens are then computed this many per
        # step after its prompt, and it continues as the uninterrupted run did. 0: with the prompt.
        self.replay_rows = 0
        # Bulk sequences take at most this many places in the running batch (0: no cap).
        self.max_running_bulk = max_running_bulk
        self.queues: tuple[deque[Sequence], ...] = tuple(deque() for _ in range(NUM_CLASSES))  # waiting, per class
        self.running: list[Sequence] = []  # in (class, admission) order
        self._seqs: dict[SeqId, Sequence] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        # Called with the seq id whenever a sequence's blocks are freed (finished, cancelled, failed,
        # preempted): a runner that mirrors the pool in its own KV cache (llama_cpp_runtime.py) listens.
        self.on_release: Callable[[SeqId], None] | None = None

    # ---- requests in and out ---------------------------------------------------------
    def add(
        self,
        seq_id: SeqId,
        prompt_tokens: Seq[int],
        max_tokens: int,
        speculative: bool = False,
        forks: int = 0,
        output_tokens: Seq[int] = (),
        prompt_rows: bool = False,
        priority: int = DEFAULT_CLASS,
    ) -> Sequence:
        """Queue a request. Raises InputError / ContextTooLong (INVALID_ARG) or QueueFull.

        ``forks``: sequences :meth:`fork` will make from it once its prompt is computed.
        ``output_tokens``: the answer's first tokens, generated elsewhere (a stream continued
        after its replica died): the sequence is admitted as a preempted one is, prompt and
        those tokens prefilled, and counts them against ``max_tokens``. ``prompt_rows``: see
        :attr:`Sequence.prompt_rows`; ``priority``: :attr:`Sequence.priority`."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already scheduled")
        # The engine checked the request (LLMEngine.check_request); here it is only asserted.
        assert prompt_tokens and max_tokens > 0, (len(prompt_tokens), max_tokens)
        assert len(prompt_tokens) + max_tokens <= self.max_model_len, "the engine admitted too much"
        assert self.bm.blocks_needed(len(prompt_tokens) + max_tokens - 1) <= self.bm.num_blocks, "the engine admitted too much"
        # Requests the running batch will take at the next step do not count as waiting.
        waiting = self.num_waiting
        queued = waiting - max(0, self.max_num_seqs - len(self.running))
        if queued >= self.max_waiting:
            raise QueueFull(waiting, self.max_num_seqs, self.max_waiting)
        assert 0 <= priority < NUM_CLASSES, priority
        assert 1 + forks <= self.max_num_seqs, "the engine admitted too many choices"
        assert len(output_tokens) < max_tokens and not (output_tokens and forks), "the engine admitted a bad continuation"
        seq = Sequence(
            seq_id,
            [int(t) for t in prompt_tokens],
            max_tokens,
            next(self._arrivals),
            output_tokens=[int(t) for t in output_tokens],
            speculative=speculative,
            num_forks=forks,
            replay_rows=self.replay_rows if output_tokens else 0,
            prompt_rows=prompt_rows,
            priority=priority,
        )
        self.queues[priority].append(seq)
        self._seqs[seq_id] = seq
        return seq

    def fork(self, parent_id: SeqId, child_id: SeqId) -> ScheduledChunk:
        """A new running sequence with ``parent_id``'s prompt and KV blocks (shared by reference),
        made in the step that computed the parent's last prompt token, before :meth:`update`.

        Returns the chunk that :meth:`update` records for the child as if it had run (its first
        token is sampled from the parent's logits): no prompt token is computed twice."""
        parent = self._seqs[parent_id]
        assert parent.status is SequenceStatus.RUNNING and not parent.output_tokens and parent.num_forks > 0
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already scheduled")
        child = Sequence(
            child_id,
            list(parent.prompt_tokens),
            parent.max_tokens,
            parent.arrival,
            status=SequenceStatus.RUNNING,
            num_computed_tokens=parent.num_computed_tokens,
            num_cached_tokens=parent.num_cached_tokens,
            num_prefill_tokens=parent.num_prefill_tokens,
            speculative=parent.speculative,
            priority=parent.priority,
        )
        self.bm.fork(parent_id, child_id)
        parent.num_forks -= 1
        self._seqs[child_id] = child
        self._run(child)
        return self._chunk(child, child.num_tokens - child.num_computed_tokens, is_prefill=True)

    def _run(self, seq: Sequence) -> None:
        """Put ``seq`` in the running list after every sequence of its class or a higher one."""
        i = len(self.running)
        while i and self.running[i - 1].priority > seq.priority:
            i -= 1
        self.running.insert(i, seq)

    @property
    def waiting(self) -> list[Sequence]:
        """The waiting sequences in the order they would be admitted."""
        return [seq for queue in self.queues for seq in queue]

    @property
    def num_places_taken(self) -> int:
        """Places in the running batch: running sequences and the forks they will make."""
        return len(self.running) + sum(s.num_forks for s in self.running)

    def get(self, seq_id: SeqId) -> Sequence | None:
        return self._seqs.get(seq_id)

    def abort(self, seq_id: SeqId) -> bool:
        """Cancel a waiting or running sequence now, freeing its blocks; idempotent."""
        return self.finish(seq_id, FinishReason.ABORT)

    def finish(self, seq_id: SeqId, reason: FinishReason) -> bool:
        """End a sequence (EOS, stop string, error, cancellation): one path that frees it."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        if seq.status is SequenceStatus.WAITING:
            self.queues[seq.priority].remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.bm.free(seq_id)
        if self.on_release is not None:
            self.on_release(seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return True

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self.queues)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def stats(self) -> dict[str, int]:
        """Gauges and counters for the metrics port, read once per engine step."""
        running = [0] * NUM_CLASSES
        for seq in self.running:
            running[seq.priority] += 1
        return {
            "num_requests_running": len(self.running),
            "num_requests_waiting": self.num_waiting,
            **{f"num_requests_waiting_{c}": len(q) for c, q in zip(PRIORITY_CLASSES, self.queues)},
            **{f"num_requests_running_{c}": n for c, n in zip(PRIORITY_CLASSES, running)},
            "kv_blocks_used": self.bm.num_used_blocks,
            "kv_blocks_total": self.bm.num_blocks,
            "kv_blocks_cached": self.bm.num_cached_blocks,
            "prefix_cache_queries": self.bm.prefix_queries,
            "prefix_cache_hits": self.bm.prefix_hits,
            "num_preemptions": self.num_preemptions,
        }

    # ---- one step ------------------------------------------------------------------------
    @staticmethod
    def _prefill_size(seq: Sequence, budget: int) -> int:
        """Tokens of ``seq``'s prefill to run this step: what the budget allows, and for a continued
        stream replayed a few rows at a time, the prompt first, then its given tokens."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if seq.replay_rows:
            prompt = len(seq.prompt_tokens)
            start = seq.num_computed_tokens
            n = min(n, prompt - start) if start < prompt else min(n, seq.replay_rows)
        return n

    def _chunk(self, seq: Sequence, n: int, is_prefill: bool) -> ScheduledChunk:
        start = seq.num_computed_tokens
        end = start + n
        tokens = seq.tokens
        return ScheduledChunk(
            seq_id=seq.seq_id,
            start=start,
            end=end,
            token_ids=tokens[start:end],
            slots=self.bm.slots(seq.seq_id, start, end),
            block_table=self.bm.block_table(seq.seq_id),
            is_prefill=is_prefill,
            samples=end == seq.num_tokens,
            prompt_rows=is_prefill and seq.prompt_rows,
        )

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """A prompt-lookup draft for ``seq``'s next decode, within its max_tokens, the step's
        budget and the free blocks; ``[]`` when none."""
        room = min(self.num_speculative_tokens, seq.max_tokens - len(seq.output_tokens) - 1, budget)
        draft = propose_ngram(seq.tokens, room)
        if draft and not self.bm.can_append_slots(seq.seq_id, len(draft)):
            return []
        return draft

    def _draft_chunk(self, seq: Sequence, draft: list[int]) -> ScheduledChunk:
        start = seq.num_computed_tokens
        for token in draft:
            self.bm.append_slot(seq.seq_id, token)
        end = start + 1 + len(draft)
        return ScheduledChunk(
            seq_id=seq.seq_id,
            start=start,
            end=end,
            token_ids=[seq.tokens[start]] + list(draft),
            slots=self.bm.slots(seq.seq_id, start, end),
            block_table=self.bm.block_table(seq.seq_id),
            is_prefill=False,
            samples=True,
            draft=list(draft),
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        if self.on_release is not None:
            self.on_release(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.replay_rows = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.queues[seq.priority].appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        """Plan one step within ``max_num_batched_tokens`` and ``max_num_seqs``."""
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        preempted: list[SeqId] = []

        # 1. Decodes: running sequences whose prompt is computed, oldest first.
        speculate = (
            self.num_speculative_tokens > 0
            and 0 < sum(1 for s in self.running if s.num_computed_tokens >= s.num_prefill_tokens) <= self.speculative_max_seqs
        )
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this loop
            if seq.num_computed_tokens < seq.num_prefill_tokens:
                continue  # still in prefill: step 2
            # Its last sampled token needs a slot; make room by preempting the newest of the lowest class.
            while not self.bm.can_append_slot(seq.seq_id):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if self.bm.num_tokens(seq.seq_id) < seq.num_tokens:
                self.bm.append_slot(seq.seq_id, seq.output_tokens[-1])
            # A draft leaves a token of the budget for every other decode (at most speculative_max_seqs).
            draft = self._draft(seq, budget - self.speculative_max_seqs) if speculate and seq.speculative else []
            if draft:
                decodes.append(self._draft_chunk(seq, draft))
            else:
                decodes.append(self._chunk(seq, 1, is_prefill=False))
            budget -= 1 + len(draft)
        if decodes and self.prefill_tokens_with_decodes:
            budget = min(budget, self.prefill_tokens_with_decodes)

        # 2. Running prefills carry on in chunks (their prompt slots exist since admission).
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_computed_tokens >= seq.num_prefill_tokens:
                continue
            n = self._prefill_size(seq, budget)
            prefills.append(self._chunk(seq, n, is_prefill=True))
            budget -= n

        # 3. Admit waiting requests, highest class first, FIFO within a class; none after a
        # preemption this step (the pool is short), and never skip a head for a lower class's
        # (no starvation of long prompts). Bulk stops at max_running_bulk places.
        taken = self.num_places_taken
        bulk = -1  # places bulk sequences take, counted when a bulk head is next
        while budget > 0 and not preempted and taken < self.max_num_seqs:
            queue = next((q for q in self.queues if q), None)
            if queue is None:
                break
            seq = queue[0]
            if taken + 1 + seq.num_forks > self.max_num_seqs or not self.bm.can_admit(seq.tokens, not seq.prompt_rows):
                break
            if seq.priority == BULK and self.max_running_bulk:
                if bulk < 0:
                    bulk = sum(1 + s.num_forks for s in self.running if s.priority == BULK)
                if bulk + 1 + seq.num_forks > self.max_running_bulk:
                    break
                bulk += 1 + seq.num_forks
            taken += 1 + seq.num_forks
            queue.popleft()
            seq.num_cached_tokens = self.bm.allocate(seq.seq_id, seq.tokens, use_cache=not seq.prompt_rows)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.num_prefill_tokens = seq.num_tokens
            seq.status = SequenceStatus.RUNNING
            self._run(seq)
            n = self._prefill_size(seq, budget)
            prefills.append(self._chunk(seq, n, is_prefill=True))
            budget -= n

        return SchedulerOutput(decodes=decodes, prefills=prefills, preempted=preempted, copies=self.bm.take_copies())

    def update(self, output: SchedulerOutput, sampled: Mapping[SeqId, int | list[int] | tuple[int, ...]]) -> list[Sequence]:
        """Record a finished step: computed tokens, and the new tokens of each sampling chunk.

        ``sampled`` gives one token per sampling chunk, or for a chunk with a draft the
        tokens it yields (``speculative.accept_draft``: the accepted draft tokens, then the
        model's own). Returns the sequences that got tokens (``num_new_tokens`` says how
        many; finished ones included, with ``finish_reason`` LENGTH when they reached
        max_tokens). Chunks of sequences aborted since :meth:`schedule` are ignored.
        """
        new: list[Sequence] = []
        for chunk in output.chunks:
            seq = self._seqs.get(chunk.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            got = sampled.get(chunk.seq_id) if chunk.samples else None
            tokens = [int(t) for t in got] if isinstance(got, (list, tuple)) else [] if got is None else [int(got)]
            end = chunk.end
            if chunk.draft:
                assert 1 <= len(tokens) <= len(chunk.draft) + 1 and tokens[:-1] == chunk.draft[: len(tokens) - 1]
                end = chunk.start + len(tokens)  # the rejected draft's K/V are not the sequence's
                self.bm.truncate(seq.seq_id, end)
            seq.num_computed_tokens = end
            self.bm.mark_computed(seq.seq_id, end)
            if not chunk.samples:
                continue
            seq.output_tokens.extend(tokens)
            seq.num_new_tokens = len(tokens)
            new.append(seq)
            if len(seq.output_tokens) >= seq.max_tokens:
                self.finish(seq.seq_id, FinishReason.LENGTH)
        return new
