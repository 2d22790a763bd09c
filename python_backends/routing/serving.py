"""The router's encoder calls for one batch, with failures isolated to the requests that cause them.

Requests are grouped by (version, padded length, pinned) and each group is ONE encoder call
(``router.group_by``). When that call fails, the group is retried request by request on the
same version, so one bad row (an out-of-vocabulary id, say) fails only its own request; a
request that still fails alone goes, if it is unpinned and fallback is on, to the other
versions (``router.fallback_versions``). Groups run concurrently, and an exception in one
group fails only that group's requests.

What is a version's fault and what is the client's: the encoder answers a request whose input
it cannot run (ONNX Runtime's INVALID_ARGUMENT) with INVALID_ARG, raised here as
``CallError(invalid=True)`` (``call_error``). A request rejected so by every version it was tried on fails with
INVALID_ARG and is tallied ``rejected``, not as an error of the version; if another version
served it, the one that rejected it is tallied an error. The tally counts requests: a call of
n requests that succeeds adds n ``ok``; a failed group call adds nothing until its requests,
retried alone, have each been counted once where they failed or were served.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from contract.errors import InputError, Unavailable, parse_error, words_of
from contract.prose import onnxruntime_invalid_input
from python_backends.routing.router import Decision, fallback_versions, group_by

log = logging.getLogger(__name__)

# (version, input_ids, attention_mask) -> embeddings [rows, d]; raises CallError (or anything)
CallFn = Callable[[int, np.ndarray, np.ndarray], Awaitable[np.ndarray]]
REJECTED = "rejected"  # the tally's result for a request every version refused as invalid input


class CallError(Exception):
    """An encoder call failed; ``invalid``: the encoder said the request's input is at fault."""

    def __init__(self, message: str, invalid: bool = False):
        super().__init__(message)
        self.invalid = invalid


def call_error(message: str, invalid_code: bool = False) -> CallError:
    """The CallError for an encoder error response. The python backend of Triton 2.51 drops a
    BLS response's error code (``request_executor.cc`` rebuilds the error from its message, as
    INTERNAL): the project's Python-based onnxruntime backend says what it was in the error's
    data; the native onnxruntime backend has none, and is recognised by ONNX Runtime's wording."""
    data = parse_error(message)
    if data is not None:
        return CallError(words_of(message), invalid=data.http_status in (400, 413))
    return CallError(message, invalid=invalid_code or onnxruntime_invalid_input(message))


@dataclass
class Job:
    ids: np.ndarray  # [rows, length] int64
    mask: np.ndarray
    decision: Decision


@dataclass
class Outcome:
    """One request's result: ``served`` and ``vectors``, or ``error`` (``invalid``: INVALID_ARG,
    ``internal``: a bug in the router, else the encoder was unavailable)."""

    served: int | None = None
    vectors: np.ndarray | None = None
    error: str | None = None
    invalid: bool = False
    internal: bool = False

    def exception(self) -> Exception:
        """A failed outcome as the error its request is answered with (contract.errors):
        the encoder refused the input ids (invalid_value), a bug in the router (internal), or
        no version could serve it now (unavailable)."""
        if self.invalid:
            return InputError("input_ids", self.error or "")
        if self.internal:
            return RuntimeError(self.error)
        return Unavailable(self.error or "")

    def version_column(self) -> np.ndarray:
        """The served version once per row, INT32 [rows, 1] (the output ``encoder_version``)."""
        assert self.vectors is not None  # a served outcome
        return np.full((self.vectors.shape[0], 1), self.served, dtype=np.int32)


class GroupServer:
    """Runs a batch's jobs through ``call``; ``tally`` has ``record(version, result, ms, requests)``
    semantics of ``router.CallTally``; ``warn(message, *args)`` is rate-limited by the caller."""

    def __init__(
        self,
        encoder: str,
        weights: Mapping[int, int],
        fallback_on_error: bool,
        ready_versions: Callable[[], Sequence[int]],
        call: CallFn,
        tally,
        warn=log.warning,
        clock=time.monotonic,
    ):
        self.encoder = encoder
        self.weights = dict(weights)
        self.fallback_on_error = fallback_on_error
        self.ready_versions = ready_versions
        self.call = call
        self.tally = tally
        self.warn = warn
        self.clock = clock

    async def serve(self, jobs: Mapping[int, Job]) -> dict[int, Outcome]:
        """{request index: Outcome} for every job."""
        groups = list(group_by([(i, job.decision, job.ids.shape[1]) for i, job in jobs.items()]).items())
        results = await asyncio.gather(
            *(self._group(version, pinned, [(i, jobs[i]) for i in members]) for (version, _, pinned), members in groups),
            return_exceptions=True,
        )
        out: dict[int, Outcome] = {}
        for ((version, _, _), members), result in zip(groups, results):
            if isinstance(result, BaseException):  # a bug: it fails this group only
                log.error(
                    "%s version %d: serving a group of %d requests failed", self.encoder, version, len(members), exc_info=result
                )
                result = {i: Outcome(error=repr(result), internal=True) for i in members}
            out.update(result)
        return out

    async def _timed(self, version: int, ids: np.ndarray, mask: np.ndarray, requests: int = 1) -> np.ndarray:
        """One call of ``requests`` requests; a success is tallied (``requests`` ok, one latency
        sample); a failure raises CallError and is tallied by the caller."""
        start = self.clock()
        try:
            vectors = np.asarray(await self.call(version, ids, mask))
        except CallError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed call of any kind is the call's failure
            raise CallError(f"{type(exc).__name__}: {exc}") from exc
        if vectors.ndim != 2 or vectors.shape[0] != ids.shape[0]:
            raise CallError(f"returned shape {list(vectors.shape)} for {ids.shape[0]} rows")
        self.tally.record(version, "ok", (self.clock() - start) * 1000.0, requests=requests)
        return vectors

    async def _group(self, version: int, pinned: bool, members: list[tuple[int, Job]]) -> dict[int, Outcome]:
        if len(members) == 1:
            i, job = members[0]
            return {i: await self._alone(version, pinned, job)}
        try:
            vectors = await self._timed(
                version,
                np.concatenate([j.ids for _, j in members]),
                np.concatenate([j.mask for _, j in members]),
                requests=len(members),
            )
        except CallError as exc:
            log.info(
                "%s version %d: a call of %d requests failed (%s); retrying them one by one",
                self.encoder,
                version,
                len(members),
                exc,
            )
        else:
            out, start = {}, 0
            for i, job in members:
                rows = job.ids.shape[0]
                out[i] = Outcome(served=version, vectors=vectors[start : start + rows])
                start += rows
            return out
        singles = await asyncio.gather(*(self._alone(version, pinned, job) for _, job in members), return_exceptions=True)
        out = {}
        for (i, _), result in zip(members, singles):
            if isinstance(result, BaseException):
                log.error("%s version %d: serving one request failed", self.encoder, version, exc_info=result)
                result = Outcome(error=repr(result), internal=True)
            out[i] = result
        return out

    async def _alone(self, version: int, pinned: bool, job: Job) -> Outcome:
        """One request on ``version``, then (unpinned, fallback on) on the other versions."""
        try:
            return Outcome(served=version, vectors=await self._timed(version, job.ids, job.mask))
        except CallError as exc:
            first = exc
        name = f"{self.encoder} version {version}"
        if pinned or not self.fallback_on_error:
            self.tally.record(version, REJECTED if first.invalid else "error", None, requests=1)
            return Outcome(error=f"{name}: {first}", invalid=first.invalid)
        rejected = [version] if first.invalid else []
        reason = first
        for other in fallback_versions(self.weights, version, self.ready_versions()):
            try:
                vectors = await self._timed(other, job.ids, job.mask)
            except CallError as exc:
                if exc.invalid:
                    rejected.append(other)
                    reason = reason if reason.invalid else exc
                else:
                    self.tally.record(other, "error", None, requests=1)
                continue
            # Another version served it: whatever ``version`` said, it failed a servable request.
            self.tally.record(version, "error", None, requests=1)
            for v in rejected[1 if first.invalid else 0 :]:
                self.tally.record(v, "error", None, requests=1)
            self.warn("%s failed (%s); served by version %d instead", name, first, other)
            return Outcome(served=other, vectors=vectors)
        if rejected:  # refused as invalid input wherever it could run at all: the client's fault
            for v in rejected:
                self.tally.record(v, REJECTED, None, requests=1)
            if not first.invalid:
                self.tally.record(version, "error", None, requests=1)
                return Outcome(error=f"{self.encoder} version {rejected[0]}: {reason}", invalid=True)
            return Outcome(error=f"{name}: {first}", invalid=True)
        self.tally.record(version, "error", None, requests=1)
        return Outcome(error=f"{name}: {first} (no other version could serve)")
