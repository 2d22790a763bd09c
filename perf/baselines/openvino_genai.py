"""OpenVINO GenAI's continuous-batching pipeline in process: the second generation peer of
``make perf-generate``.

``ContinuousBatchingPipeline`` (what OpenVINO Model Server runs for LLMs) on the peer's Q4_0 GGUF
(perf/baselines/llama_cpp.py). One thread (:class:`Pipeline`) steps it while any request is
unfinished; requests come as token ids, each token reaches its callback with the time it was read,
and a cancelled request is dropped at once. ``SchedulerConfig``: 1 GB KV cache, 64 sequences, a
512-token budget with split-fuse, prefix caching off; ``INFERENCE_NUM_THREADS`` = the CPUs.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEDULER: dict[str, Any] = {
    "cache_size": 1,  # GB of KV cache
    "max_num_seqs": 64,
    "max_num_batched_tokens": 512,
    "dynamic_split_fuse": True,
    "enable_prefix_caching": False,
}


@dataclass
class _Request:
    rid: int
    token_ids: Sequence[int]
    max_tokens: int
    on_tokens: Callable[[int, float], None]  # (new tokens, perf_counter when read)
    on_done: Callable[[str | None], None]  # error or None
    handle: Any = None


class Pipeline:
    """One ContinuousBatchingPipeline and the thread that steps it."""

    def __init__(self, model: Path, threads: int):
        import openvino_genai as ov_genai

        self._ov = ov_genai
        config = ov_genai.SchedulerConfig()
        for key, value in SCHEDULER.items():
            setattr(config, key, value)
        self.settings = {**SCHEDULER, "INFERENCE_NUM_THREADS": threads}
        self.pipe = ov_genai.ContinuousBatchingPipeline(str(model), config, "CPU", {"INFERENCE_NUM_THREADS": threads})
        self._ids = itertools.count()
        self._incoming: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._cancel: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._active: dict[int, _Request] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="openvino-genai", daemon=True)
        self._thread.start()

    def submit(self, token_ids: Sequence[int], max_tokens: int, on_tokens, on_done) -> int:
        rid = next(self._ids)
        self._incoming.put(_Request(rid, list(token_ids), max_tokens, on_tokens, on_done))
        self._wake.set()
        return rid

    def cancel(self, rid: int) -> None:
        self._cancel.put(rid)
        self._wake.set()

    def busy(self) -> bool:
        return bool(self._active) or not self._incoming.empty()

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _config(self, max_tokens: int):
        cfg = self._ov.GenerationConfig()
        cfg.max_new_tokens = max_tokens
        cfg.min_new_tokens = max_tokens
        cfg.ignore_eos = True
        cfg.do_sample = False
        return cfg

    def _admit(self) -> None:
        import numpy as np
        import openvino as ov

        while True:
            try:
                r = self._incoming.get_nowait()
            except queue.Empty:
                return
            try:
                ids = ov.Tensor(np.asarray([r.token_ids], dtype=np.int64))
                r.handle = self.pipe.add_request(r.rid, ids, self._config(r.max_tokens))
                self._active[r.rid] = r
            except Exception as exc:  # noqa: BLE001 - the request's error, the pipeline goes on
                r.on_done(f"{type(exc).__name__}: {exc}")

    def _drop_cancelled(self) -> None:
        while True:
            try:
                rid = self._cancel.get_nowait()
            except queue.Empty:
                return
            r = self._active.pop(rid, None)
            if r is not None:
                r.handle.cancel()
                r.on_done("cancelled")

    def _run(self) -> None:
        finished = self._ov.GenerationStatus.FINISHED
        running = self._ov.GenerationStatus.RUNNING
        while not self._stopped:
            self._admit()
            self._drop_cancelled()
            if not self.pipe.has_non_finished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.pipe.step()
            except Exception as exc:  # noqa: BLE001 - every request in the step fails with it
                for r in self._active.values():
                    r.on_done(f"step failed: {type(exc).__name__}: {exc}")
                self._active.clear()
                continue
            now = time.perf_counter()
            for rid, r in list(self._active.items()):
                if r.handle.can_read():
                    n = sum(len(out.generated_ids) for out in r.handle.read().values())
                    if n:
                        r.on_tokens(n, now)
                status = r.handle.get_status()
                if status == finished or (status != running and not r.handle.can_read()):
                    del self._active[rid]
                    r.on_done(None if status == finished else f"status {status}")
