"""The serving side of the generation engine: ``EngineLoop`` runs an ``LLMEngine`` in one
background thread, takes submissions from any thread (each validated in the caller's thread),
drops cancelled requests between steps, and reports each request's outputs and the engine's
stats (python_backends/generation/engine.py holds the engine itself)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from contract.errors import RequestError, Unavailable
from python_backends.generation.engine import LLMEngine, RequestId, RequestOutput
from python_backends.generation.sampling import SamplingParams
from python_backends.generation.scheduler import FinishReason, QueueFull

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


@dataclass
class _Submission:
    request_id: RequestId
    prompt_ids: list[int]
    params: SamplingParams
    on_output: OutputCallback
    is_cancelled: Callable[[], bool] | None
    arrival: float = field(default_factory=time.monotonic)
    prefix_ids: list[int] = field(default_factory=list)


class EngineLoop:
    """Runs an engine in one background thread: the serving side of the engine.

    ``submit`` validates in the caller's thread (so a bad request fails at once, with
    its field named) and hands the request to the loop, which adds it between two
    steps. Every step first drops requests whose ``is_cancelled()`` is true or that
    were aborted, so their blocks are free within one step. ``on_output`` is called in
    the loop thread for every new piece, and exactly once with ``finished`` true.
    """

    def __init__(
        self,
        engine: LLMEngine,
        name: str = "generation-engine",
        on_stats: Callable[[dict], None] | None = None,
        stats_interval: float = 0.5,
    ):
        self.engine = engine
        # Called in the loop thread with engine.stats() at most every stats_interval seconds
        # while it works, and once when it goes idle (the metrics port's gauges).
        self._on_stats = on_stats
        self._stats_interval = stats_interval
        self._stats_at = 0.0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: collections.deque[_Submission] = collections.deque()
        self._aborts: set[RequestId] = set()
        self._live: dict[RequestId, _Submission] = {}
        self._stopping = False
        self.step_errors = 0
        self._window_s = float(engine.config.admission_window_ms) / 1000.0
        self._quiet_s = float(engine.config.admission_quiet_ms) / 1000.0
        self._last_submit = 0.0  # monotonic time of the latest submit
        self._submits = 0  # submits so far
        self.admission_waits = 0  # windows waited, and the seconds they took (tests, metrics)
        self.admission_wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self,
        request_id: RequestId,
        prompt: str | Seq[int],
        params: SamplingParams,
        on_output: OutputCallback,
        is_cancelled: Callable[[], bool] | None = None,
        prefix_ids: Seq[int] = (),
    ) -> int:
        """Queue a request (``prefix_ids``: as for LLMEngine.check_request); returns its prompt
        length. Raises InputError or QueueFull."""
        ids = self.engine.encode(prompt)
        prefix = [int(t) for t in prefix_ids]
        params = self.engine.check_request(ids, params, prefix)
        sub = _Submission(request_id, ids, params, on_output, is_cancelled, prefix_ids=prefix)
        with self._lock:
            if self._stopping:
                raise Unavailable("the engine is shutting down")
            if request_id in self._live or any(p.request_id == request_id for p in self._pending):
                raise ValueError(f"request {request_id!r} is already running")
            # Submissions not yet handed to the scheduler count as waiting, less the free
            # places in the running batch they will take at the next step.
            sched = self.engine.scheduler
            free_places = max(0, sched.max_num_seqs - sched.num_running)
            waiting = max(0, sched.num_waiting + len(self._pending) - free_places)
            if waiting >= self.engine.config.max_waiting:
                raise QueueFull(waiting, sched.max_num_seqs, self.engine.config.max_waiting)
            self._pending.append(sub)
            self._last_submit = time.monotonic()
            self._submits += 1
            self._wake.notify()
        return len(ids)

    def abort(self, request_id: RequestId) -> None:
        with self._lock:
            self._aborts.add(request_id)
            self._wake.notify()

    def stats(self) -> dict[str, int]:
        with self._lock:
            stats = self.engine.stats()
            stats["num_requests_waiting"] += len(self._pending)
        return stats

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; every unfinished request gets a final ``abort`` output."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    def _emit(self, out: RequestOutput) -> None:
        sub = self._live.get(out.request_id)
        if out.last:
            self._live.pop(out.request_id, None)
        if sub is None:
            return
        try:
            sub.on_output(out)
        except Exception:  # noqa: BLE001 - a failing callback must not stop other streams
            log.exception("output callback of request %r failed; cancelling it", out.request_id)
            if not out.last:
                self._aborts.add(out.request_id)

    def _admit_and_cancel(self) -> None:
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
            aborts = set(self._aborts)
            self._aborts.clear()
        for sub in pending:
            self._live[sub.request_id] = sub
            try:
                self.engine.admit(sub.request_id, sub.prompt_ids, sub.params, arrival=sub.arrival, prefix_ids=sub.prefix_ids)
            except (RequestError, ValueError) as exc:
                self._emit(
                    RequestOutput(
                        sub.request_id, "", [], True, FinishReason.ABORT.value, len(sub.prompt_ids), 0, None, exc, last=True
                    )
                )
        for rid, sub in list(self._live.items()):
            if rid in aborts or (sub.is_cancelled is not None and _cancelled(sub.is_cancelled)):
                outs = self.engine.abort(rid)
                for out in outs:
                    self._emit(out)
                if not outs:
                    self._live.pop(rid, None)

    def _report_stats(self, force: bool = False) -> None:
        if self._on_stats is None:
            return
        now = time.monotonic()
        if force or now - self._stats_at >= self._stats_interval:
            self._stats_at = now
            try:
                self._on_stats(self.engine.stats())
            except Exception:  # noqa: BLE001 - metrics never stop generation
                log.exception("stats callback failed")

    def _gather(self, since: float, expected: int | None, submits_since: int) -> None:
        """The admission window: wait (lock held) while a burst's requests are still arriving.

        Ends at ``admission_window_ms`` after ``since``, once ``admission_quiet_ms`` passed with
        no new submission (counted from ``since`` or the latest one), once ``expected``
        submissions came after the first ``submits_since`` (the clients of the requests the last
        step finished), or once the running batch has no free place left for them."""
        start = time.monotonic()
        deadline = since + self._window_s
        sched = self.engine.scheduler
        while not self._stopping:
            if expected is not None and self._submits - submits_since >= expected:
                break
            if sched.num_running + len(self._pending) >= sched.max_num_seqs:
                break
            now = time.monotonic()
            end = min(deadline, max(since, self._last_submit) + self._quiet_s)
            if now >= end:
                break
            self._wake.wait(end - now)
        waited = time.monotonic() - start
        if waited > 0.0005:
            self.admission_waits += 1
            self.admission_wait_s += waited

    def _run(self) -> None:
        # When the latest step ended, how many requests it finished, the submits until then.
        finished_at, finished, submits_at = 0.0, 0, 0
        while True:
            with self._lock:
                idle = not self._pending and not self._aborts and not self.engine.has_unfinished()
            if idle:
                self._report_stats(force=True)
            with self._lock:
                while not self._stopping and not self._pending and not self._aborts and not self.engine.has_unfinished():
                    self._wake.wait()
                if self._stopping:
                    break
                if self._window_s > 0:
                    if finished and time.monotonic() < finished_at + self._window_s:
                        # The clients of the requests just finished are sending their next ones, maybe.
                        self._gather(finished_at, finished, submits_at)
                    elif idle and self._pending:  # woke from idle: the first of a burst, maybe
                        self._gather(self._last_submit, None, 0)
            finished = 0
            self._admit_and_cancel()
            if not self.engine.has_unfinished():
                continue
            self._report_stats()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep the server up
                self.step_errors += 1
                log.exception("engine step failed; failing its %d requests", self.engine.num_requests)
                outputs = self.engine.fail_all(RuntimeError(f"generation failed: {exc}"))
            # Count submits before the outputs go out: a client that gets its last output may
            # send its next request before this thread runs again, and that one must count.
            with self._lock:
                submits_at = self._submits
            for out in outputs:
                self._emit(out)
            finished = sum(1 for out in outputs if out.last)
            finished_at = time.monotonic()
        for out in self.engine.fail_all(Unavailable("the model is unloading")):
            self._emit(out)
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        for sub in pending:
            sub.on_output(
                RequestOutput(
                    sub.request_id,
                    "",
                    [],
                    True,
                    FinishReason.ABORT.value,
                    len(sub.prompt_ids),
                    0,
                    None,
                    Unavailable("the model is unloading"),
                    last=True,
                )
            )


def _cancelled(is_cancelled: Callable[[], bool]) -> bool:
    try:
        return bool(is_cancelled())
    except Exception:  # noqa: BLE001 - a sender that cannot answer is gone
        return True
