"""The generation engine: continuous batching over a paged KV cache, and its loop thread.

:class:`LLMEngine` is synchronous and single-threaded: requests are added, and each
:meth:`LLMEngine.step` schedules one batch (every running decode plus prefill chunks
under a token budget), runs one forward through :class:`ModelRunner`, samples, checks
stops and returns the new text pieces. :class:`EngineLoop` owns an engine in one
background thread and is what the Triton model uses: ``submit`` from any thread,
outputs through a callback, cancellation checked before every step.

Nothing here imports Triton; ``model_repository/text_generation/1/model.py`` is the shim.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from contract.errors import ConfigError, InputError
from contract.sampling import PRIORITY_CLASSES
from python_backends.generation import logprobs as lp
from python_backends.generation.block_manager import BlockManager
from python_backends.generation.detokenizer import IncrementalDetokenizer
from python_backends.generation.engine_config import EngineConfig
from python_backends.generation.linear import describe_cpu, kv_cache_dtype, runnable_precisions
from python_backends.generation.llama_cpp_runtime import (
    LLAMA_PRECISIONS,
    GGUFWeights,
    LlamaCppRunner,
    kv_bytes_per_block,
)
from python_backends.generation.model_runner import DTYPES, LlamaWeights, ModelRunner
from python_backends.generation.openvino_runtime import OV_PRECISIONS, OpenVINORunner, OVWeights
from python_backends.generation.paged_attention import bytes_per_block
from python_backends.generation.sampling import Sampler, SamplingParams, make_generator
from python_backends.generation.scheduler import ContextTooLong, FinishReason, Scheduler, SchedulerOutput, SeqId
from python_backends.generation.speculative import accept_draft
from python_backends.generation.structured import Fitting, Grammars

log = logging.getLogger(__name__)

RequestId = Hashable
# The input that carries a continued stream's first tokens (config.pbtxt), named in its errors.
PREFIX_FIELD = "prefix_token_ids"


@dataclass(frozen=True)
class ChoiceId:
    """The sequence of choice ``index`` > 0 of a request with ``n`` > 1 (choice 0's is the request id)."""

    request_id: RequestId
    index: int


@dataclass
class RequestMetrics:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass
class RequestOutput:
    """What one step added to one request. ``text`` and ``token_ids`` are the new part only."""

    request_id: RequestId
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics | None = None
    error: Exception | None = None  # set when the engine failed this request (finished too)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first scheduled
    # The log-probabilities of the tokens whose text this output completes (None: not asked for).
    logprobs: list[lp.TokenLogprob] | None = None
    index: int = 0  # the choice (0..n-1) this output is about
    # No more outputs for this request: ``finished`` and every other choice finished earlier.
    last: bool = False
    # fit_structure_to_max_tokens steered the answer to a closing that fits (set on the final output).
    structure_fitted: bool = False
    # With the choice's first output, when asked (SamplingParams.prompt_logprobs): one entry per
    # prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[lp.TokenLogprob | None] | None = None


@dataclass
class _Request:
    request_id: RequestId
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    metrics: RequestMetrics
    num_emitted_ids: int = 0
    num_cached_tokens: int = 0
    aligner: lp.Aligner | None = None  # set when the request asked for log-probabilities
    matcher: Any = None  # the guide's llguidance matcher (structured outputs), None without a guide
    fit: Fitting | None = None  # fit_structure_to_max_tokens of a guided request
    seq_id: SeqId = None  # the request id for choice 0, ChoiceId for the others
    index: int = 0
    # Choice 0 until its prompt is computed: the other choices, forked from it then.
    forks: list[_Request] = field(default_factory=list)
    # Asked for (SamplingParams.prompt_logprobs): [None, then each prompt token's entry as its prefill
    # computes it]; handed out with the first output, then None.
    prompt_logprobs: list[lp.TokenLogprob | None] | None = None


class LLMEngine:
    """One model, one KV pool, one scheduler. Not thread-safe: see :class:`EngineLoop`."""

    def __init__(self, config: EngineConfig, weights: LlamaWeights | GGUFWeights | OVWeights | None = None, tokenizer=None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(int(config.num_threads))
        dtype = DTYPES[config.dtype]
        self.device = torch.device(config.device)
        model_dir = Path(config.model_dir)
        on_llama = config.weights_precision in LLAMA_PRECISIONS
        on_openvino = config.weights_precision in OV_PRECISIONS
        if weights is None:
            if on_llama:
                weights = GGUFWeights.from_folder(model_dir, config.weights_precision)
            elif on_openvino:
                weights = OVWeights.from_folder(model_dir, config.weights_precision)
            else:
                weights = LlamaWeights.from_folder(model_dir, dtype, self.device, config.weights_precision)
        self.weights = weights
        mcfg = self.weights.config
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer = tokenizer
        self.max_model_len = min(config.max_model_len, mcfg.max_position_embeddings)
        if on_llama or on_openvino:  # OpenVINO's cache holds 2-byte K/V (BF16 or F16)
            per_block = kv_bytes_per_block(mcfg, config.block_size, config.kv_cache_type if on_llama else "f16")
        else:
            kv_dtype = kv_cache_dtype(self.weights.precision, dtype, self.device)
            per_block = bytes_per_block(mcfg.num_layers, config.block_size, mcfg.num_kv_heads, mcfg.head_dim, kv_dtype)
        num_blocks = config.num_blocks or config.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_bytes {config.kv_cache_bytes} holds no block of {per_block} bytes")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            max_waiting=config.max_waiting,
            max_model_len=self.max_model_len,
            num_speculative_tokens=config.num_speculative_tokens,
            speculative_max_seqs=config.speculative_max_seqs,
            prefill_tokens_with_decodes=config.prefill_tokens_with_decodes,
            max_running_bulk=config.max_running_bulk,
        )
        self.runner: ModelRunner | LlamaCppRunner | OpenVINORunner
        if on_llama:
            assert isinstance(self.weights, GGUFWeights)
            # A step holds the token budget plus the drafts of the decodes that carry one.
            step_tokens = self.scheduler.max_num_batched_tokens + config.num_speculative_tokens * config.speculative_max_seqs
            self.runner = LlamaCppRunner(
                self.weights,
                self.block_manager,
                self.max_model_len,
                step_tokens,
                num_threads=config.num_threads,
                kv_type=config.kv_cache_type,
                flash_attn=config.flash_attn,
                prefix_cells=config.llama_prefix_cells,
            )
            self.scheduler.on_release = self.runner.release
            kv_mib = self.runner.kv_nbytes() / 2**20
        elif on_openvino:
            assert isinstance(self.weights, OVWeights)
            self.runner = OpenVINORunner(self.weights, num_blocks, config.block_size, self.max_model_len, config.num_threads)
            kv_mib = self.runner.kv_nbytes() / 2**20
        else:
            assert isinstance(self.weights, LlamaWeights)
            self.runner = ModelRunner(self.weights, num_blocks, config.block_size, self.max_model_len, self.device, dtype)
            kv_mib = self.runner.cache.nbytes() / 2**20
            if self.device.type == "cpu" and self.weights.precision not in runnable_precisions():
                log.warning(
                    "generation engine: weights_precision %s is not offered on this CPU (%s): PyTorch emulates "
                    "its kernels here, slower than fp32; export on this machine (python -m export) to gate "
                    "what it runs, or serve PRECISION=fp32",
                    self.weights.precision,
                    describe_cpu(),
                )
        log.info(
            "generation engine: weights %s (%.0f MiB), KV pool %d blocks of %d tokens (%.0f MiB), %s",
            self.weights.precision,
            self.weights.nbytes() / 2**20,
            num_blocks,
            config.block_size,
            kv_mib,
            self.device,
        )
        self.scheduler.replay_rows = int(getattr(self.runner, "replay_rows", 0))
        eos = set(mcfg.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = sorted(eos)
        self.sampler = Sampler(self.eos_token_ids)
        self._requests: dict[RequestId, _Request] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self.last_step_seconds = 0.0
        self.token_bytes = lp.TokenBytes(self.tokenizer)
        self._grammars: Grammars | None = None  # made on the first guided request
        self._grammars_lock = threading.Lock()
        self._step_logprobs: dict[SeqId, list[lp.TokenLogprob]] = {}  # what the step's sampling computed
        # Requests with n > 1: their choices' sequences not finished yet (forked or still to be).
        self._choices: dict[RequestId, list[SeqId]] = {}
        # What the step's sampling drew for choices forked from a prompt just computed:
        # choice 0's sequence -> (choice, first token, its log-probabilities) each.
        self._step_forks: dict[SeqId, list[tuple[_Request, int, list[lp.TokenLogprob]]]] = {}

    # ---- requests ------------------------------------------------------------------------
    def encode(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of a prompt (text as the tokenizer encodes it, or ids as given)."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InputError("text_input", "the prompt is empty or only whitespace")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        ids = [int(t) for t in prompt]
        vocab = self.weights.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InputError("text_input", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def check_request(self, prompt_ids: Seq[int], params: SamplingParams, prefix_ids: Seq[int] = ()) -> SamplingParams:
        """The engine's admission rules, checked once before a request is queued: the prompt and
        ``max_tokens`` fit the context and the KV pool. Returns the params to run (``max_tokens``
        lowered to the room left when ``fit_to_context``); ContextTooLong (INVALID_ARG) otherwise.

        ``prefix_ids``: the answer's first tokens, already sent to the client by a replica that
        died (a continued stream, docs/generation.md#streams-that-outlive-a-replica); they count
        against ``max_tokens`` and must leave room for one more."""
        if not prompt_ids:
            raise InputError("text_input", "the prompt has no tokens")
        if params.n > self.scheduler.max_num_seqs:
            raise InputError(
                "n",
                f"{params.n} choices; this model runs at most {self.scheduler.max_num_seqs} sequences at once",
                values={"maximum": self.scheduler.max_num_seqs},
            )
        vocab = self.weights.config.vocab_size
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:  # sorted by id: the last is the largest
            token = params.logit_bias[-1][0]
            raise InputError(
                f"logit_bias[{str(token)!r}]",
                f"token id {token} is outside the vocabulary [0, {vocab})",
                values={"maximum": vocab - 1},
            )
        if params.stop_token_ids and params.stop_token_ids[-1] >= vocab:  # sorted: the last is the largest
            raise InputError(
                "stop_token_ids",
                f"token id {params.stop_token_ids[-1]} is outside the vocabulary [0, {vocab})",
                values={"maximum": vocab - 1, "got": params.stop_token_ids[-1]},
            )
        guide = params.guide
        if guide is not None:
            self.grammars().compile(*guide)  # here, on the submitting thread: the loop only makes a matcher
        if prefix_ids:
            self._check_prefix(prefix_ids, params, vocab)
        prompt = len(prompt_ids)
        # The last generated token is never fed back: a sequence holds total - 1 slots at most.
        limit = min(self.max_model_len, self.scheduler.bm.num_blocks * self.scheduler.bm.block_size + 1)
        room = limit - prompt
        if params.fit_to_context and 0 < room < params.max_tokens:
            params = replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room), fit_to_context=False)
        # max_tokens 0 (the prompt's log-probabilities alone) still samples once after the prompt.
        if prompt + max(params.max_tokens, 1) > limit:
            raise ContextTooLong(prompt, params.max_tokens, limit, pool=limit < self.max_model_len)
        if prefix_ids and len(prefix_ids) >= params.max_tokens:
            raise InputError(
                PREFIX_FIELD,
                f"{len(prefix_ids)} tokens already sent leave none of max_tokens ({params.max_tokens}) to generate",
                values={"maximum": params.max_tokens - 1, "got": len(prefix_ids)},
            )
        return params

    @staticmethod
    def _check_prefix(prefix_ids: Seq[int], params: SamplingParams, vocab: int) -> None:
        """What a continuation may carry: token ids of the vocabulary, for a request whose next
        tokens depend only on the tokens so far (one choice, no log-probabilities to realign)."""
        bad = [t for t in prefix_ids if not 0 <= t < vocab]
        if bad:
            raise InputError(
                PREFIX_FIELD,
                f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                values={"maximum": vocab - 1, "got": bad[0]},
            )
        if params.n != 1:
            raise InputError(
                PREFIX_FIELD, f"a continuation continues one choice; this request asks n={params.n}", values={"n": params.n}
            )
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise InputError(
                PREFIX_FIELD, "a continuation cannot return log-probabilities (those of the prefix were sent already)"
            )

    def add_request(
        self,
        request_id: RequestId,
        prompt: str | Seq[int],
        params: SamplingParams,
        arrival: float | None = None,
        prefix_ids: Seq[int] = (),
    ) -> None:
        """Queue a request; raises InputError / ContextTooLong (INVALID_ARG) or QueueFull.
        ``prefix_ids``: as for :meth:`check_request`."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        ids = self.encode(prompt)
        prefix = [int(t) for t in prefix_ids]
        self.admit(request_id, ids, self.check_request(ids, params, prefix), arrival, prefix)

    def grammars(self) -> Grammars:
        """The compiled guides of this engine's tokenizer (made on first use: 0.5 s)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.weights.config.vocab_size)
            return self._grammars

    def admit(
        self,
        request_id: RequestId,
        ids: list[int],
        params: SamplingParams,
        arrival: float | None = None,
        prefix_ids: Seq[int] = (),
    ) -> None:
        """Queue a request that passed :meth:`check_request` (QueueFull when the queue is full).

        With ``n`` > 1 one sequence is queued; the other choices are forked from it once its
        prompt is computed (:meth:`step`), sharing its KV blocks: one prefill for all.

        With ``prefix_ids`` the sequence starts as if it had generated them here: they are
        prefilled after the prompt (as a preempted sequence's tokens are), the detokenizer reads
        them, a guide consumes them and a seeded generator draws past them, so the tokens that
        follow are those an uninterrupted run samples next."""
        guide = params.guide
        arrival = time.monotonic() if arrival is None else arrival
        matcher = None if guide is None else self.grammars().matcher(*guide)
        if matcher is not None:
            for position, token in enumerate(prefix_ids):
                if not matcher.consume_token(token):
                    raise InputError(
                        PREFIX_FIELD,
                        f"token {token} at position {position} breaks the request's guide",
                        values={"position": position, "got": token},
                    )
        # A guided sequence is not drafted: its mask is computed one token at a time.
        # max_tokens 0: the sequence runs as one of 1 whose sampled token the step drops.
        self.scheduler.add(
            request_id,
            ids,
            max(params.max_tokens, 1),
            speculative=params.greedy and guide is None,
            forks=params.n - 1,
            output_tokens=prefix_ids,
            prompt_rows=params.prompt_logprobs is not None,
            priority=PRIORITY_CLASSES.index(params.priority_class),
        )

        def choice(index: int) -> _Request:
            seed = None if params.seed is None else (params.seed + index) % 2**63
            return _Request(
                request_id,
                ids,
                params,
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids=ids,
                    stop=params.stop,
                    skip_special_tokens=params.skip_special_tokens,
                    include_stop=params.include_stop_str_in_output,
                ),
                make_generator(seed, self.device),
                RequestMetrics(arrival=arrival),
                aligner=None if params.logprobs is None else lp.Aligner(self.token_bytes),
                matcher=matcher if index == 0 else None if guide is None else self.grammars().matcher(*guide),
                fit=self.grammars().fitting(guide[0]) if guide is not None and params.fit_structure_to_max_tokens else None,
                seq_id=request_id if index == 0 else ChoiceId(request_id, index),
                index=index,
            )

        first = choice(0)
        if params.prompt_logprobs is not None:
            first.prompt_logprobs = [None]
        if prefix_ids:
            _continue_after(first, list(prefix_ids))
            if first.fit is not None:
                for token in prefix_ids:
                    first.fit.seen(token)
        if params.n > 1:
            first.forks = [choice(i) for i in range(1, params.n)]
            self._choices[request_id] = [request_id, *(c.seq_id for c in first.forks)]
        self._requests[request_id] = first
        self.counters["requests_added"] += 1

    def abort(self, request_id: RequestId) -> list[RequestOutput]:
        """Cancel a request now, every choice of it: its blocks are free when this returns.

        Returns the final output of each choice that had not finished (none: it was not
        running). Idempotent."""
        outs = []
        for seq_id in list(self._choices.get(request_id, (request_id,))):
            req = self._requests.pop(seq_id, None)
            self.scheduler.abort(seq_id)
            if req is None:
                continue
            for choice in [req, *req.forks]:  # choices not forked yet end with the first
                outs.append(self._final(choice, "", FinishReason.ABORT.value))
        if outs:
            self.counters["requests_aborted"] += 1
        return outs

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> dict[str, int]:
        out = dict(self.scheduler.stats())
        out.update(self.counters)
        return out

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one batch; return the outputs it produced."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        start = time.monotonic()
        for chunk in plan.chunks:
            req = self._requests[chunk.seq_id]
            if req.metrics.first_scheduled is None:
                req.metrics.first_scheduled = start
                seq = self.scheduler.get(chunk.seq_id)
                req.num_cached_tokens = 0 if seq is None else min(seq.num_cached_tokens, len(req.prompt_ids))
        self.counters["prompt_tokens_computed"] += sum(c.num_tokens for c in plan.prefills)
        failed: list[RequestOutput] = []
        self._step_logprobs.clear()
        self._step_forks.clear()
        try:
            sampled = self._run(plan)
        except Exception as exc:  # noqa: BLE001 - isolated below; re-raised if every request fails
            sampled, failed = self._run_isolated(plan, exc)
        for parent, forked in self._step_forks.items():
            first = self._requests.get(parent)
            if first is None:  # failed alone in this step
                continue
            first.forks = []
            for choice, token, logprobs in forked:
                plan.prefills.append(self.scheduler.fork(parent, choice.seq_id))
                sampled[choice.seq_id] = token
                choice.metrics.first_scheduled = first.metrics.first_scheduled
                choice.num_cached_tokens = first.num_cached_tokens
                choice.prompt_logprobs = None if first.prompt_logprobs is None else list(first.prompt_logprobs)
                self._requests[choice.seq_id] = choice
                if logprobs:
                    self._step_logprobs[choice.seq_id] = logprobs
                self.counters["sequences_forked"] += 1
        new = self.scheduler.update(plan, sampled)
        now = time.monotonic()
        self.last_step_seconds = now - start
        self.counters["steps"] += 1
        self.counters["generation_tokens"] += sum(s.num_new_tokens for s in new)
        outputs = failed
        for seq in new:
            req = self._requests[seq.seq_id]
            m = req.metrics
            if m.first_token is None:
                m.first_token = now
            m.last_token = now
            # One token, or several after an accepted draft: each is checked for a stop in turn,
            # and what follows a stop is dropped, as if they had come one step at a time.
            finish = None
            text = ""
            if req.aligner is not None:
                req.aligner.add(self._step_logprobs.pop(seq.seq_id, ()))
            total = len(seq.output_tokens)
            guide_done = req.matcher is not None and req.matcher.is_stopped()  # a complete guide allows EOS alone
            piece = None
            if req.params.max_tokens == 0:  # the prompt alone: the token sampled after it is dropped
                del seq.output_tokens[:]
                finish = FinishReason.LENGTH.value
                total = seq.num_new_tokens = 0
            for upto in range(total - seq.num_new_tokens + 1, total + 1):
                token = seq.output_tokens[upto - 1]
                if seq.finish_reason is FinishReason.LENGTH and upto == total:
                    finish = FinishReason.LENGTH.value
                elif self._stops(req.params, token) and (upto >= req.params.min_tokens or guide_done):
                    finish = FinishReason.STOP.value
                # the whole list for the newest token (no copy per step); a prefix only inside a draft;
                # a stop token's own text only where the request keeps it (vLLM's rule)
                if finish == FinishReason.STOP.value and not req.params.include_stop_str_in_output:
                    piece = req.detokenizer.step(seq.output_tokens[: upto - 1])
                else:
                    piece = req.detokenizer.step(seq.output_tokens if upto == total else seq.output_tokens[:upto])
                text += piece.text
                if piece.finish_reason == "stop":
                    finish = "stop"  # a stop string: the text before it is the answer
                if finish is not None:
                    del seq.output_tokens[upto:]
                    break
            if finish == FinishReason.LENGTH.value and req.fit is not None and req.matcher.is_accepting():
                finish = FinishReason.STOP.value  # fitted: the answer is complete at its last token
            if finish is not None:
                self.scheduler.finish(seq.seq_id, FinishReason(finish))
                text += req.detokenizer.finish().text if piece is None or piece.finish_reason != "stop" else ""
                del self._requests[seq.seq_id]
                outputs.append(self._final(req, text, finish, seq.output_tokens))
                outputs[-1].prompt_logprobs = self._take_prompt_logprobs(req)
                if req.aligner is not None:  # the last of the tokens the sequence kept
                    outputs[-1].logprobs = req.aligner.finish(len(seq.output_tokens))
            else:
                ids = seq.output_tokens[req.num_emitted_ids :]
                req.num_emitted_ids = len(seq.output_tokens)
                outputs.append(
                    RequestOutput(
                        req.request_id,
                        text,
                        ids,
                        False,
                        None,
                        len(req.prompt_ids),
                        len(seq.output_tokens),
                        m,
                        num_cached_tokens=req.num_cached_tokens,
                        logprobs=None if req.aligner is None else req.aligner.release(text, len(seq.output_tokens)),
                        index=req.index,
                        prompt_logprobs=self._take_prompt_logprobs(req),
                    )
                )
        return outputs

    @staticmethod
    def _take_prompt_logprobs(req: _Request) -> list[lp.TokenLogprob | None] | None:
        """The prompt's entries, once: with the choice's first output."""
        got, req.prompt_logprobs = req.prompt_logprobs, None
        return got

    def _add_prompt_logprobs(self, chunk, rows: torch.Tensor) -> None:
        """The entries of the prompt tokens that ``chunk``'s rows score (row j holds the logits after
        position ``start + j``, which score the token at ``start + j + 1``), from where the request's
        list stands: rows recomputed after a preemption add nothing twice."""
        req = self._requests.get(chunk.seq_id)
        got = None if req is None else req.prompt_logprobs
        if req is None or got is None:  # handed out already (a recompute after a preemption)
            return
        prompt = req.prompt_ids
        first = len(got) - 1 - chunk.start
        last = min(chunk.num_tokens, len(prompt) - 1 - chunk.start)
        assert first >= 0, "prompt rows run in order from position 0 (no prefix-cache hits)"
        if first < last:
            targets = prompt[chunk.start + first + 1 : chunk.start + last + 1]
            k = req.params.prompt_logprobs or 0
            got.extend(lp.compute(rows[first:last], targets, [k] * len(targets)))
        if len(got) == len(prompt):
            seq = self.scheduler.get(chunk.seq_id)
            if seq is not None:
                seq.prompt_rows = False  # a recompute after a preemption needs no rows

    def _stops(self, params: SamplingParams, token: int) -> bool:
        """Whether ``token`` ends its sequence: EOS (unless ``ignore_eos``) or one of ``stop_token_ids``."""
        return (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids

    def _run(self, plan: SchedulerOutput) -> dict[SeqId, int | list[int]]:
        """Run the model on ``plan`` and sample its sampling chunks: seq_id -> new token, or
        for a chunk with a draft the tokens the draft yields (``accept_draft``)."""
        logits = self.runner.execute(plan)
        sampling = []  # (chunk, the logits row of its first sampled row)
        base = 0
        for c in plan.chunks:
            if c.prompt_rows:
                self._add_prompt_logprobs(c, logits[base : base + c.num_logits])
            if c.samples:
                sampling.append((c, base + c.num_logits - c.num_samples))
            base += c.num_logits
        if not sampling:
            return {}
        # One sampler row per logits row: a draft's row j sees the sequence plus draft[:j].
        params: list[SamplingParams] = []
        history: list[tuple[Any, list[int]]] = []
        generated: list[int] = []
        generators: list[torch.Generator | None] = []
        guided: list[tuple[int, _Request]] = []  # (row, choice) of each guided sequence
        source: list[int] = []  # the logits row of each sampler row (choices to fork share their prompt's)
        penalty = False
        for c, first_row in sampling:
            req, seq = self._requests[c.seq_id], self.scheduler.get(c.seq_id)
            assert seq is not None  # a scheduled chunk's sequence
            penalty = penalty or req.params.penalises_history
            # The prompt's last row: choice 0 samples from it, and so does each choice forked now.
            last = range(c.num_samples - 1, c.num_samples)
            for choice, logit_rows in [(req, range(c.num_samples)), *((f, last) for f in req.forks)]:
                if choice.matcher is not None:  # never drafted: one row
                    guided.append((len(params), choice))
                for j in logit_rows:
                    source.append(first_row + j)
                    params.append(choice.params)
                    history.append((seq, c.draft[:j]))
                    generated.append(len(seq.output_tokens) + j)
                    generators.append(choice.generator)
        if source != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.as_tensor(source, device=logits.device))
        allowed = None
        if guided:
            masks = self.grammars().allowed([c.matcher for _, c in guided]).to(logits.device)
            allowed = dict(zip((r for r, _ in guided), masks))
        tokens = self.sampler(
            logits,
            params,
            token_ids=[s.tokens + d for s, d in history] if penalty else None,
            num_generated=generated,
            generators=generators,
            allowed=allowed,
        ).tolist()
        for r, choice in guided:
            if choice.fit is not None:  # may put the closing's token in the sampled one's place
                tokens[r] = choice.fit.take(choice.matcher, tokens[r], generated[r], choice.params.max_tokens)
            elif not choice.matcher.consume_token(tokens[r]):
                log.warning("structured output: the guide refused sampled token %d (%s)", tokens[r], choice.matcher.get_error())
        # Log-probabilities from the logits the step already has, for the rows that asked only.
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        by_row: dict[int, lp.TokenLogprob] = {}
        if want:
            rows = torch.as_tensor(want, device=logits.device)
            entries = lp.compute(logits.index_select(0, rows), [tokens[i] for i in want], [params[i].logprobs or 0 for i in want])
            by_row = dict(zip(want, entries))
        out: dict[SeqId, int | list[int]] = {}
        row = 0
        for c, _ in sampling:
            forks = self._requests[c.seq_id].forks
            if forks:  # rows after choice 0's: the first token of each choice forked now
                self._step_forks[c.seq_id] = [
                    (f, tokens[row + k], [by_row[row + k]] if row + k in by_row else []) for k, f in enumerate(forks, 1)
                ]
            if c.draft:
                accepted = accept_draft(c.draft, tokens[row : row + c.num_samples])
                out[c.seq_id] = accepted
                self.counters["spec_draft_tokens"] += len(c.draft)
                self.counters["spec_accepted_tokens"] += len(accepted) - 1
                n = len(accepted)
            else:
                out[c.seq_id] = tokens[row]
                n = 1
            if row in by_row:
                self._step_logprobs[c.seq_id] = [by_row[row + j] for j in range(n)]
            row += c.num_samples + len(forks)
        return out

    def _run_isolated(self, plan: SchedulerOutput, error: Exception) -> tuple[dict[SeqId, int | list[int]], list[RequestOutput]]:
        """The step failed: run each request's chunks alone (as the encoder retries a failed
        batch row by row), so that only the requests that fail alone get the error and the others
        go on with the tokens of their own runs. Safe because the failed step changed no
        scheduler state after :meth:`Scheduler.schedule` (the slots it planned are reused, the
        KV entries it wrote are written again). Every request failing alone means the step
        itself is broken: the original error is raised (the loop then fails them all)."""
        self.counters["steps_isolated"] += 1
        by_seq: dict[SeqId, list] = {}
        for chunk in plan.chunks:
            by_seq.setdefault(chunk.seq_id, []).append(chunk)
        sampled: dict[SeqId, int | list[int]] = {}
        culprits: dict[SeqId, Exception] = {}
        for seq_id, chunks in by_seq.items():
            alone = SchedulerOutput(
                decodes=[c for c in chunks if not c.is_prefill], prefills=[c for c in chunks if c.is_prefill], preempted=[]
            )
            try:
                sampled.update(self._run(alone))
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                culprits[seq_id] = exc
        if len(culprits) == len(by_seq):
            raise error
        failed = []
        for seq_id, cause in culprits.items():
            log.warning("generation step failed because of request %r (%s); failing it alone", seq_id, cause)
            for out in self.abort(seq_id):  # that choice only, when it is one of n
                out.error = RuntimeError(f"generation failed: {cause}")
                failed.append(out)
        self.counters["requests_failed_alone"] += len(failed)
        return sampled, failed

    def _final(self, req: _Request, text: str, reason: str, output_ids: list[int] | None = None) -> RequestOutput:
        req.metrics.finished = time.monotonic()
        ids = [] if output_ids is None else output_ids[req.num_emitted_ids :]
        n_out = req.num_emitted_ids + len(ids) if output_ids is not None else req.num_emitted_ids
        self.counters[f"finished_{reason}"] += 1
        return RequestOutput(
            req.request_id,
            text,
            ids,
            True,
            reason,
            len(req.prompt_ids),
            n_out,
            req.metrics,
            num_cached_tokens=req.num_cached_tokens,
            index=req.index,
            last=self._retire(req),
            structure_fitted=req.fit is not None and req.fit.fitted,
        )

    def _retire(self, req: _Request) -> bool:
        """Drop a finished choice from its request's live choices; whether none is left."""
        live = self._choices.get(req.request_id)
        if live is None:
            return True
        if req.seq_id in live:
            live.remove(req.seq_id)
        if live:
            return False
        del self._choices[req.request_id]
        return True

    def fail_all(self, error: Exception) -> list[RequestOutput]:
        """Finish every request with ``error`` (a failed step): free everything, keep serving."""
        outs = []
        for rid in list(self._requests):
            for out in self.abort(rid):
                out.error = error
                outs.append(out)
        return outs

    # ---- convenience ---------------------------------------------------------------------
    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams]) -> list[tuple[str, list[int]]]:
        """Run prompts to completion together; returns (text, output ids) per prompt."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        base = self.counters["requests_added"]
        ids = [("generate", base, i) for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        texts: dict[RequestId, list[str]] = {rid: [] for rid in ids}
        tokens: dict[RequestId, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._requests or rid in self._choices for rid in ids):
            for out in self.step():
                if out.request_id in texts and out.index == 0:
                    texts[out.request_id].append(out.text)
                    tokens[out.request_id].extend(out.token_ids)
        return [("".join(texts[r]), tokens[r]) for r in ids]


def _continue_after(req: _Request, prefix_ids: list[int]) -> None:
    """Bring a new request's state to where a run that generated ``prefix_ids`` stands: its
    detokenizer has read them one at a time (the same pieces, the same text held back for a stop
    string), and a sampled request's generator has drawn once per token (Sampler: one uniform
    per sampled row and step; greedy rows draw none)."""
    for upto in range(1, len(prefix_ids) + 1):
        req.detokenizer.step(prefix_ids[:upto])
    req.num_emitted_ids = len(prefix_ids)
    if req.generator is not None and not req.params.greedy:
        for _ in prefix_ids:
            torch.rand((), generator=req.generator, device=req.generator.device)
