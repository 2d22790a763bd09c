"""The text_generation model without Triton: its config checked at load, the engine and its
loop, each request parsed and handed to the loop, and each engine output turned into the
values of one response.

The model.py shim supplies a :class:`Reply` per request (its response sender) and the metrics;
docs/generation.md describes the model.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from contract.errors import ConfigError
from contract.model_config import ModelConfig
from python_backends.generation.engine import LLMEngine, RequestOutput
from python_backends.generation.engine_config import EngineConfig
from python_backends.generation.engine_loop import EngineLoop
from python_backends.generation.sampling import SamplingParams, sampling_defaults
from python_backends.generation.serving import BOOL_INPUTS, ResponseShaper, engine_settings, parse_request

log = logging.getLogger(__name__)

# The inputs a request may carry, and each output's array type.
INPUT_NAMES = ("text_input", "sampling_parameters", "prefix_token_ids", "prompt_token_ids", *BOOL_INPUTS)
OUTPUT_TYPES = {
    "text_output": object,
    "finish_reason": object,
    "num_input_tokens": np.uint32,
    "num_output_tokens": np.uint32,
    "num_cached_tokens": np.uint32,
    "logprobs": object,
    "index": np.uint32,
    "token_ids": np.int32,
    "structure_fitted": np.bool_,
    "prompt_logprobs": object,
}


class Reply(Protocol):
    """One request's way back to its client (the shim wraps Triton's response sender)."""

    def send(self, arrays: dict[str, np.ndarray], final: bool) -> None: ...

    def fail(self, error: BaseException) -> None: ...

    def close(self) -> None: ...

    def is_cancelled(self) -> bool: ...


def output_arrays(values: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """One response's outputs (ResponseShaper's values; None: not sent) as one-element arrays,
    a list as an array of its own length."""
    arrays = {}
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, list):
            arrays[name] = np.asarray(value, dtype=OUTPUT_TYPES[name])
        elif OUTPUT_TYPES[name] is object:
            arrays[name] = np.array([str(value).encode("utf-8")], dtype=object)
        else:
            arrays[name] = np.array([value], dtype=OUTPUT_TYPES[name])
    return arrays


class ReplyPump:
    """Sends the loop's responses from a thread of its own, in order, and watches the streams for
    cancellation.

    Triton's response sender waits for tritonserver to take each response, and ``is_cancelled`` asks
    it too (a round trip to the server process each). In the engine's thread both cost every step:
    at 16 streams 15 % of the loop was spent in ``send`` and 5 % in ``is_cancelled``, against 73 % in
    the forward pass (py-spy on the served stub). Here they overlap the next step's forward pass,
    which runs without the GIL. A stream found cancelled, or whose send fails, is aborted through
    ``on_cancel`` (the engine frees its blocks at its next step); the watch runs whenever the queue
    is drained, at most every ``poll_s``, and asks at most ``max_polls_per_s`` streams a second,
    taking them in turn: a stream is asked every ``poll_s`` up to ``max_polls_per_s * poll_s``
    streams, less often beyond (at 200 a second, every 80 ms at 16 streams, 160 ms at 32).
    """

    _STOP = object()

    def __init__(self, on_cancel: Callable[[Any], None], poll_s: float = 0.02, max_polls_per_s: float = 200.0):
        if poll_s <= 0 or max_polls_per_s <= 0:
            raise ValueError(f"cancellation polling needs poll_s > 0 and max_polls_per_s > 0, got {poll_s}, {max_polls_per_s}")
        self.on_cancel = on_cancel
        self.poll_s = poll_s
        self.polls_per_sweep = max(1, int(max_polls_per_s * poll_s))
        self.polls = 0  # is_cancelled calls so far (tests, profiling)
        self._turn = 0  # where the next sweep starts among the watched streams
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._watched: dict[Any, Reply] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="generation-replies", daemon=True)
        self._thread.start()

    def watch(self, request_id: Any, reply: Reply) -> None:
        with self._lock:
            self._watched[request_id] = reply

    def unwatch(self, request_id: Any) -> None:
        with self._lock:
            self._watched.pop(request_id, None)

    def send(self, request_id: Any, reply: Reply, arrays: dict[str, np.ndarray], final: bool) -> None:
        self._jobs.put((request_id, reply.send, (arrays, final), final))

    def fail(self, request_id: Any, reply: Reply, error: BaseException) -> None:
        self._jobs.put((request_id, reply.fail, (error,), True))

    def close(self, request_id: Any, reply: Reply) -> None:
        self._jobs.put((request_id, reply.close, (), True))

    def stop(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop."""
        self._jobs.put(self._STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        polled = time.monotonic()
        while True:
            try:
                job = self._jobs.get(timeout=self.poll_s)
            except queue.Empty:
                job = None
            if job is self._STOP:
                return
            if job is not None:
                request_id, call, args, last = job
                if last:
                    self.unwatch(request_id)
                try:
                    call(*args)
                except Exception:  # noqa: BLE001 - one stream's failure never stops the others
                    log.exception("response of request %r could not be sent; cancelling it", request_id)
                    if not last:
                        self.unwatch(request_id)
                        self.on_cancel(request_id)
                if not self._jobs.empty():
                    continue
            now = time.monotonic()
            if now - polled >= self.poll_s:
                polled = now
                self._watch_cancellations()

    def _watch_cancellations(self) -> None:
        with self._lock:
            watched = list(self._watched.items())
        if len(watched) > self.polls_per_sweep:  # this sweep's share, in turn
            start = self._turn % len(watched)
            watched = (watched[start:] + watched[:start])[: self.polls_per_sweep]
            self._turn = start + self.polls_per_sweep
        self.polls += len(watched)
        for request_id, reply in watched:
            try:
                cancelled = bool(reply.is_cancelled())
            except Exception:  # noqa: BLE001 - a sender that cannot say counts as gone
                cancelled = True
            if cancelled:
                self.unwatch(request_id)
                self.on_cancel(request_id)


class GenerationEntry:
    """``config``: the model's parsed config; ``version_dir``: its exported weights and tokenizer;
    ``decoupled``: what the config's transaction policy says; ``gpu_device``: the instance's
    device id on a KIND_GPU instance, else None."""

    def __init__(self, config: ModelConfig, version_dir: Path, *, decoupled: bool, gpu_device: str | None = None):
        if not decoupled:
            raise ConfigError(f"{config.name} must be decoupled (model_transaction_policy {{ decoupled: true }})")
        config.require("input", "text_input", "TYPE_STRING", (1,))
        config.require("output", "text_output", "TYPE_STRING", (-1,))
        settings = engine_settings(config.param, config.param_int, config.param_bool)
        device = "cpu" if gpu_device is None else f"cuda:{gpu_device}"
        if settings["dtype"] == "auto":
            settings["dtype"] = "float32" if gpu_device is None else "bfloat16"
        generation_config = Path(version_dir) / "generation_config.json"
        model_sampling = json.loads(generation_config.read_text(encoding="utf-8")) if generation_config.is_file() else {}
        settings["sampling_defaults"] = sampling_defaults(model_sampling, config.param("sampling_defaults"))
        if config.param_bool("fit_structure_to_max_tokens", False):  # for requests that do not say
            settings["sampling_defaults"]["fit_structure_to_max_tokens"] = True
        self.name = config.name
        self.max_text_bytes = config.param_int("max_text_bytes", 262144, minimum=1)
        self.engine = LLMEngine(EngineConfig(model_dir=Path(version_dir), device=device, **settings))
        # One short generation so the first client does not pay for lazy initialisation.
        self.engine.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0))
        self.loop: EngineLoop | None = None
        self.replies: ReplyPump | None = None
        self.on_output: Callable[[RequestOutput], None] | None = None
        self.ids = itertools.count()

    def start(self, on_stats: Callable | None = None, on_output: Callable[[RequestOutput], None] | None = None) -> None:
        """Start the engine's loop thread; ``on_stats`` and ``on_output`` feed the metrics."""
        self.on_output = on_output
        self.loop = loop = EngineLoop(self.engine, on_stats=on_stats)
        self.replies = ReplyPump(on_cancel=loop.abort)

    def submit(self, inputs: Mapping[str, Any], parameters: Mapping[str, Any], reply: Reply) -> None:
        """Check one request (``inputs``: INPUT_NAMES to arrays or None) and queue it; raises
        InputError, ContextTooLong or QueueFull (nothing was queued), else the loop answers
        through ``reply``."""
        assert self.loop is not None, "start() first"
        engine = self.engine
        parsed = parse_request(
            inputs,
            parameters,
            tokenizer=engine.tokenizer,
            max_tokens_limit=engine.config.max_tokens_limit,
            default_max_tokens=engine.config.default_max_tokens,
            max_text_bytes=self.max_text_bytes,
            sampling_defaults=engine.config.sampling_defaults,
        )
        shaper = ResponseShaper(parsed, engine.token_bytes)
        assert self.replies is not None
        request_id = next(self.ids)
        self.replies.watch(request_id, reply)  # its cancellation, watched by the pump
        try:
            self.loop.submit(
                request_id,
                list(parsed.prompt_ids) or parsed.prompt,
                parsed.params,
                self._answer(shaper, reply, self.replies),
                prefix_ids=parsed.prefix_ids,
            )
        except BaseException:
            self.replies.unwatch(request_id)
            raise

    def _answer(self, shaper: ResponseShaper, reply: Reply, replies: ReplyPump) -> Callable[[RequestOutput], None]:
        done = False  # the reply was failed or closed: the other choices' outputs go nowhere

        def on_output(out: RequestOutput) -> None:
            nonlocal done
            if self.on_output is not None:
                self.on_output(out)
            if done:
                return
            if out.error is not None:
                done = True
                replies.fail(out.request_id, reply, out.error)
                if not out.last:  # one choice failed: the request fails, its other choices stop
                    assert self.loop is not None
                    self.loop.abort(out.request_id)
                return
            if out.finish_reason == "abort" and reply.is_cancelled():
                if out.last:
                    replies.close(out.request_id, reply)  # the client is gone: close the stream, nothing to say
                return
            values = shaper.on_output(
                out.text,
                out.finished,
                out.finish_reason,
                out.num_input_tokens,
                out.num_output_tokens,
                out.num_cached_tokens,
                out.logprobs,
                out.index,
                out.token_ids,
                out.prompt_logprobs,
                structure_fitted=out.structure_fitted,
            )
            if values is None:
                if out.last:
                    replies.close(out.request_id, reply)
                return
            replies.send(out.request_id, reply, output_arrays(values), out.last)

        return on_output

    def close(self) -> None:
        """Stop the loop (requests still running are aborted)."""
        if self.loop is not None:
            self.loop.shutdown()
        if self.replies is not None:
            self.replies.stop()
