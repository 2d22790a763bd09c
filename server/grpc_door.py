"""The gRPC front door: a proxy on the public gRPC port that checks every inference request.

nginx cannot look inside protobuf, so tritonserver's gRPC port used to be reachable through it
unchecked, and one ``ModelInfer`` whose declared dims wrap around 2^64 killed a python backend
stub (docs/security.md). This process parses each ``ModelInferRequest`` header (the bytes go on as
they came, but for a continuable stream's requests, re-encoded with the token ids asked for:
``server.stream_resume``), checks it with ``server.grpc_check`` and answers a refusal
itself: ``INVALID_ARGUMENT`` for ``ModelInfer``, an error response on the stream for
``ModelStreamInfer`` (as Triton reports a failed request there; the stream goes on). Every other
RPC (health, metadata, statistics, the repository API with its token) passes through unchanged,
metadata, deadline and status included; an unknown method too.

Errors carry their data (contract/errors.py) where gRPC does: a call's error (the door's own
refusals, and the models' errors forwarded) has its status from the data's code, the words as
details and the data as ``error-data`` trailing metadata; a stream's error response has no status
and no metadata, so its ``error_message`` keeps the data after the words.

With ``--stream-listen`` the same process serves Triton's HTTP ``generate_stream`` for the front
door's nginx (``server.stream_door``): those streams are continued or ended as this door's are.

Readiness tells the truth: while the launcher's watchdog has a model marked unhealthy (a dead
python backend stub, ``server.stubs``), ``ModelReady`` of that model, ``ServerReady`` and the
standard ``grpc.health.v1.Health/Check`` answer not ready.

Run by the launcher (``GrpcDoor``), in front of nginx's internal gRPC listener::

    python -m server.grpc_door --listen 127.0.0.1:8001 --upstream 127.0.0.1:<nginx grpc> \\
        --repository model_repository --health-dir .triton/health
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc import aio

from contract.errors import ERROR_METADATA, GRPC_STATUS, UNAVAILABLE, ErrorData, data_json, format_data, parse_error
from server.grpc_check import Limits, Refusal, check_request
from server.replica_probes import ReplicaProbes, probe_url
from server.stream_resume import StreamBook, continuable_models

log = logging.getLogger("grpc_door")

SERVICE = "/inference.GRPCInferenceService/"
INFER = SERVICE + "ModelInfer"
STREAM = SERVICE + "ModelStreamInfer"
SERVER_READY = SERVICE + "ServerReady"
MODEL_READY = SERVICE + "ModelReady"
REPOSITORY_LOAD = SERVICE + "RepositoryModelLoad"
REPOSITORY_UNLOAD = SERVICE + "RepositoryModelUnload"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
# Sends of one inference request while its model is marked unhealthy, and the pause between.
HEALING_RETRIES = 3
HEALING_BACKOFF_S = 0.05
# The metadata nginx's gRPC listener puts on its own UNAVAILABLE when a replica died with the
# call in flight (deploy/frontdoor/nginx.conf.template), and how often such a call is resent.
UPSTREAM_LOST = "frontdoor-upstream-lost"
UPSTREAM_LOST_RETRIES = 2
# While serve-cluster restarts a replica: how long NOT_FOUND of a repository model is resent, how often.
NOT_FOUND_WAIT_S = 10.0
NOT_FOUND_BACKOFF_S = 0.1
# How long an INTERNAL answer waits for the watchdog to mark its model (its scan interval, twice).
WATCHDOG_WAIT_S = 0.5
# A stream lost with continuable requests in flight: how long its requests are sent again (a
# replica's model reloading takes 6-8 s), the pause before a new call, and how long a continuable
# stream must be silent while its model is marked on some replica before it counts as lost.
RESUME_WAIT_S = 30.0
RESUME_BACKOFF_S = 0.05
SILENT_STREAM_S = 1.0
# Metadata the channel sets itself; the rest (the repository token among it) goes on.
_OWN_METADATA = ("user-agent", "content-type", "te", "grpc-")


def unhealthy_models(health_dir: Path | None) -> dict[str, str]:
    """model -> reason, from the watchdog's files (one per model with a dead stub)."""
    if health_dir is None:
        return {}
    try:
        names = os.listdir(health_dir)
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.startswith("."):
            continue
        try:
            out[name] = (Path(health_dir) / name).read_text(encoding="utf-8").strip()
        except OSError:
            continue
    return out


@dataclass(frozen=True)
class StreamLost:
    """A stream's model was marked unhealthy by the watchdog while the stream was open."""

    model: str
    reason: str


class Door:
    """The generic handler: every method, forwarded as bytes; inference checked first."""

    def __init__(
        self,
        upstream: str,
        limits: Limits,
        health_dir: Path | None,
        max_message_bytes: int,
        starting_file: Path | None = None,
        healing_dirs: tuple[Path, ...] = (),
    ):
        from tritonclient.grpc import service_pb2

        # serve-cluster: each replica's watchdog folder. A model marked in one of them is being
        # reloaded on that replica: an INTERNAL answer for it is resent, and a continuable stream
        # silent while it is marked is continued (never used for readiness: the stream may run on a
        # healthy replica).
        self.healing_dirs = tuple(healing_dirs)

        # serve-cluster writes this file while a replica listed in nginx is not ready (dead, or
        # restarted and loading): such a replica may answer NOT_FOUND for a model its rollout
        # state defers (server/repository_prep.py). While the file exists, NOT_FOUND for a model of the
        # repository is resent (nginx balances each send) for at most NOT_FOUND_WAIT_S.
        self.starting_file = starting_file
        # docker-compose: the replicas' probe ports, polled (server/replica_probes.py); set by serve().
        self.replica_probes: ReplicaProbes | None = None
        self.not_found_retries = 0

        self.pb = service_pb2
        self.limits = limits
        self.health_dir = health_dir
        options = [("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes)]
        self.channel = aio.insecure_channel(upstream, options=options)
        self.refused = 0
        self.healing_retries = 0
        self.upstream_lost_retries = 0
        # Models whose streams are continued on another call when their replica is lost.
        self.continuable = continuable_models(limits.models)
        self.streams_resumed = 0
        self.requests_resumed = 0

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def metadata(context) -> tuple:
        return tuple(
            (k, v) for k, v in (context.invocation_metadata() or ()) if not k.startswith(":") and not k.startswith(_OWN_METADATA)
        )

    @staticmethod
    def timeout(context) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None or remaining > 1e8 else max(remaining, 0.001)

    async def _abort_with(self, context, exc: aio.AioRpcError):
        trailing = await _safe_trailing(exc)
        details = exc.details() or ""
        data = parse_error(details)
        if data is None:  # tritonserver's own error (or one already public): as it came
            await context.abort(exc.code(), details, trailing)
        else:  # a model's error: its data out of the words, where gRPC carries it
            kept = tuple((k, v) for k, v in trailing if k != ERROR_METADATA)
            await context.abort(status_code(data), data.message, kept + error_metadata(data))

    def _parse(self, data: bytes):
        try:
            return self.pb.ModelInferRequest.FromString(data), None
        except Exception as exc:  # DecodeError
            return None, Refusal("request", "protobuf", f"the request is not a valid ModelInferRequest ({exc})")

    # -- unary ---------------------------------------------------------------------------------

    async def unary(self, method: str, request: bytes, context):
        call = self.channel.unary_unary(method)(request, metadata=self.metadata(context), timeout=self.timeout(context))
        try:
            response = await call
        except aio.AioRpcError as exc:
            await self._abort_with(context, exc)
        trailing = await call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
        return response

    async def infer(self, request: bytes, context):
        parsed, refusal = self._parse(request)
        if refusal is None:
            refusal = check_request(parsed, self.limits, stream=False)
        if refusal is not None:
            self.refused += 1
            await abort_with_data(context, refusal.data)
        # While the watchdog reloads a model whose instance died, tritonserver answers the requests
        # it routes to the dead instance INTERNAL ("Stub process ... is not healthy"): inference is
        # idempotent, so such a request is sent again (the healthy instances answer it); if every
        # try fails it gets UNAVAILABLE, which clients retry, never a 500-class status.
        not_found_until = None
        attempt = 0
        while attempt <= max(HEALING_RETRIES, UPSTREAM_LOST_RETRIES):
            call = self.channel.unary_unary(INFER)(request, metadata=self.metadata(context), timeout=self.timeout(context))
            try:
                response = await call
            except aio.AioRpcError as exc:
                if (
                    exc.code() == grpc.StatusCode.NOT_FOUND
                    and parsed.model_name in self.limits.models
                    and self.replica_starting()
                ):
                    # A restarting replica without the model yet: the next send may reach another.
                    now = time.monotonic()
                    not_found_until = not_found_until or now + NOT_FOUND_WAIT_S
                    if now < not_found_until:
                        self.not_found_retries += 1
                        await asyncio.sleep(NOT_FOUND_BACKOFF_S)
                        continue
                lost = exc.code() == grpc.StatusCode.UNAVAILABLE and any(k == UPSTREAM_LOST for k, _ in await _safe_trailing(exc))
                if lost and attempt < UPSTREAM_LOST_RETRIES:
                    # nginx lost the replica serving it (serve-cluster): send it again; nginx
                    # picks a live replica.
                    self.upstream_lost_retries += 1
                    await asyncio.sleep(HEALING_BACKOFF_S * (attempt + 1))
                    attempt += 1
                    continue
                reason = None
                if exc.code() == grpc.StatusCode.INTERNAL:
                    reason = self._lost_instance(parsed.model_name)
                    if reason is None and attempt == 0:
                        # A request in the dead stub's batch fails at once, before the watchdog's
                        # next scan (a few per second) marks the model: give it that long. (The
                        # same for a replica that died: serve-cluster's supervisor ticks 5 times a second.)
                        await asyncio.sleep(WATCHDOG_WAIT_S)
                        reason = self._lost_instance(parsed.model_name)
                if reason is None:
                    await self._abort_with(context, exc)
                if attempt >= HEALING_RETRIES:
                    message = f"model {parsed.model_name} is being reloaded ({reason}): retry"
                    await abort_with_data(context, ErrorData(UNAVAILABLE, None, {}, message))
                self.healing_retries += 1
                await asyncio.sleep(HEALING_BACKOFF_S * (attempt + 1))
                attempt += 1
                continue
            trailing = await call.trailing_metadata()
            if trailing:
                context.set_trailing_metadata(tuple(trailing))
            return response

    async def one_replica_only(self, request: bytes, context):
        """serve-cluster and docker-compose: a gRPC load or unload would reach one replica through nginx."""
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "replicas behind this door: load and unload go through the front door's HTTP repository API "
            "(POST /v2/repository/models/<model>/load|unload), which acts on every replica; "
            "over gRPC they would reach one replica",
        )

    def _healing(self, model: str) -> str | None:
        """The watchdog's reason when ``model`` is marked unhealthy, else None."""
        return unhealthy_models(self.health_dir).get(model)

    def _healing_anywhere(self, model: str) -> str | None:
        """As ``_healing``, also in the replicas' folders (serve-cluster) or on their probe ports
        (docker-compose: the watchdog's marks each replica's readiness lists)."""
        for folder in (self.health_dir, *self.healing_dirs):
            reason = unhealthy_models(folder).get(model)
            if reason is not None:
                return reason
        return self.replica_probes.marked(model) if self.replica_probes is not None else None

    def replica_starting(self) -> bool:
        """A replica behind nginx is not ready now: serve-cluster's starting file exists, or
        (docker-compose) a replica's probe port does not answer ready (server/replica_probes.py)."""
        if self.starting_file is not None and self.starting_file.exists():
            return True
        return self.replica_probes is not None and self.replica_probes.starting()

    def _lost_instance(self, model: str) -> str | None:
        """Why an INTERNAL answer for ``model`` is an instance lost rather than the request's
        fault: a watchdog has the model marked (a dead stub), or serve-cluster has a listed
        replica down (nginx resets the calls in flight on it: "Stream removed"). None: neither."""
        reason = self._healing_anywhere(model)
        if reason is None and self.replica_starting():
            reason = "a replica was lost with the call in flight"
        return reason

    async def server_ready(self, request: bytes, context):
        if unhealthy_models(self.health_dir):
            return self.pb.ServerReadyResponse(ready=False).SerializeToString()
        return await self.unary(SERVER_READY, request, context)

    async def model_ready(self, request: bytes, context):
        try:
            name = self.pb.ModelReadyRequest.FromString(request).name
        except Exception:
            name = ""
        if name and name in unhealthy_models(self.health_dir):
            return self.pb.ModelReadyResponse(ready=False).SerializeToString()
        return await self.unary(MODEL_READY, request, context)

    async def health_check(self, request: bytes, context):
        if unhealthy_models(self.health_dir):
            return b"\x08\x02"  # HealthCheckResponse{status: NOT_SERVING}
        return await self.unary(HEALTH_CHECK, request, context)

    # -- streams -------------------------------------------------------------------------------

    def _stream_error(self, parsed, refusal: Refusal) -> bytes:
        # A stream's error response has no status or metadata of its own, and tritonclient gives a
        # stream's callback its error_message alone: the data follows the words there, as in the
        # models' own stream errors, so a client reads the code, field and limit the same way.
        response = self.pb.ModelStreamInferResponse(error_message=format_data(refusal.data))
        if parsed is not None:
            response.infer_response.id = parsed.id
            response.infer_response.model_name = parsed.model_name
            response.infer_response.model_version = parsed.model_version
        return response.SerializeToString()

    async def stream_infer(self, request_iterator, context):
        """Each client message checked; a refused one answered on the stream, the others sent on.

        A stream whose upstream is lost (a replica died, a stub died) with continuable requests in
        flight goes on on a new upstream call: each of them is sent again with the token ids its
        client got as ``prefix_token_ids`` (server/stream_resume.py), so the client sees the rest
        of the answer, no error and no token twice."""
        out: asyncio.Queue = asyncio.Queue()
        to_upstream: asyncio.Queue = asyncio.Queue()
        models: set[str] = set()
        done = object()
        book = StreamBook(self.continuable, self.pb)
        client_closed = False
        generation = 0  # the current upstream call; items of older ones are dropped

        async def requests(resend: list[bytes]):
            nonlocal client_closed
            for message in resend:
                yield message
            while not client_closed:
                item = await to_upstream.get()
                if item is done:
                    client_closed = True
                    return
                request_id, message = item
                book.mark_sent(request_id)
                yield message

        def open_call(resend: list[bytes]):
            call = self.channel.stream_stream(STREAM)(
                requests(resend), metadata=self.metadata(context), timeout=self.timeout(context)
            )
            return call, asyncio.ensure_future(read_upstream(call, generation))

        async def read_client():
            try:
                async for message in request_iterator:
                    parsed, refusal = self._parse(message)
                    if refusal is None:
                        refusal = check_request(parsed, self.limits, stream=True)
                    if refusal is not None:
                        self.refused += 1
                        await out.put((None, self._stream_error(parsed, refusal)))  # on any call
                    else:
                        models.add(parsed.model_name)
                        await to_upstream.put((parsed.id, book.outgoing(parsed) or message))
            finally:
                await to_upstream.put(done)

        async def read_upstream(call, mine: int):
            try:
                async for response in call:
                    await out.put((mine, response))
                await out.put((mine, done))
            except aio.AioRpcError as exc:
                await out.put((mine, exc))

        last_response = time.monotonic()

        async def watch_health(after_loss: bool):
            # A decoupled model's stub that dies leaves its streams open forever in tritonserver
            # 2.51 (no response will come, and none says so): once the watchdog marks a model
            # this stream sent to, the stream is lost (continued, or ended UNAVAILABLE). After a
            # loss, watching starts again once the mark is gone (the model reloaded). serve-cluster
            # (the replicas' folders) and compose (their probe ports): a model marked on some
            # replica loses a continuable stream that went silent.
            mine = generation
            while True:
                await asyncio.sleep(WATCHDOG_WAIT_S / 2)
                dead = {m: r for m in models if (r := self._healing(m)) is not None}
                if after_loss:  # until the model is reloaded wherever it was marked
                    after_loss = any(self._healing_anywhere(m) is not None for m in models)
                    continue
                if not dead and (self.healing_dirs or self.replica_probes is not None) and book.can_resume():
                    if time.monotonic() - last_response >= SILENT_STREAM_S:
                        dead = {m: r for m in models if (r := self._healing_anywhere(m)) is not None}
                if dead:
                    model, reason = next(iter(dead.items()))
                    await out.put((mine, StreamLost(model, reason)))
                    return

        reader = asyncio.ensure_future(read_client())
        call, pump = open_call([])
        watcher = asyncio.ensure_future(watch_health(False))
        lost_since: float | None = None  # the first loss since the stream's latest answer
        attempts = 0

        async def resume(reason: str, after_loss: bool) -> bool:
            """Send the requests in flight again on a new call; False once RESUME_WAIT_S is spent."""
            nonlocal call, pump, watcher, generation, lost_since, attempts, last_response
            now = time.monotonic()
            lost_since = now if lost_since is None else lost_since
            if now - lost_since >= RESUME_WAIT_S:
                return False
            resend = book.resubmissions()
            self.streams_resumed += 1
            self.requests_resumed += len(resend)
            log.info(
                "stream lost (%s): %d request(s) continued on a new call after %d token(s) sent",
                reason,
                len(resend),
                sum(len(t.ids) for t in book.tracked.values() if t.sent),
            )
            call.cancel()
            pump.cancel()
            watcher.cancel()
            await asyncio.sleep(RESUME_BACKOFF_S * 2 ** min(attempts, 4))
            attempts += 1
            generation += 1
            # the new call's silence counts from now: a continuation first replays what was sent
            last_response = time.monotonic()
            call, pump = open_call(resend)
            watcher = asyncio.ensure_future(watch_health(after_loss))
            return True

        try:
            while True:
                mine, item = await out.get()
                if mine is not None and mine != generation:
                    continue  # from a call given up
                if mine is None:  # the door's own refusal of a request: never a tracked one's answer
                    yield item
                    continue
                if item is done:
                    break
                if isinstance(item, (StreamLost, aio.AioRpcError)):
                    reason = await self._loss_reason(item, models)
                    if reason is not None and book.can_resume():
                        # nginx (or the model, once reloaded) takes the requests again.
                        marked = any(self._healing_anywhere(m) is not None for m in models)
                        if await resume(reason, isinstance(item, StreamLost) or marked):
                            continue
                    if isinstance(item, StreamLost):
                        message = f"model {item.model} lost the instance serving this stream ({item.reason}): retry"
                        await abort_with_data(context, ErrorData(UNAVAILABLE, None, {}, message))
                    assert isinstance(item, aio.AioRpcError)
                    if reason is not None and item.code() != grpc.StatusCode.UNAVAILABLE:
                        lost = ", ".join(sorted(models))
                        message = f"model {lost} lost the instance serving this stream ({reason}): retry"
                        await abort_with_data(context, ErrorData(UNAVAILABLE, None, {}, message))
                    await self._abort_with(context, item)
                last_response = time.monotonic()
                item, tracked, error = book.incoming(item)
                if tracked is not None and error:
                    # tritonserver's own error for a request whose instance died ("Stub process ...
                    # is not healthy"), or for one sent again to a replica that cannot take it yet
                    # (NOT_FOUND while it starts, the dead instance while its model reloads): the
                    # request goes on elsewhere, or later. A model's own error (its data) goes on.
                    model = tracked.request.model_name
                    reason = None
                    if tracked.responses and book.can_resume() and parse_error(error) is None:
                        reason = self._lost_instance(model)
                        if reason is None and tracked.resends:
                            # sent again: tritonserver's own errors while the model reloads (the dead
                            # instance, then "not ready") pass, within RESUME_WAIT_S
                            reason = f"sent again, answered: {error[:120]}"
                        elif reason is None:
                            await asyncio.sleep(WATCHDOG_WAIT_S)  # the watchdog's next scan marks it
                            reason = self._lost_instance(model)
                    if reason is not None and await resume(reason, self._healing_anywhere(model) is not None):
                        continue
                    book.done(tracked.request.id)
                elif tracked is not None:
                    lost_since, attempts = None, 0
                yield item
        finally:
            reader.cancel()
            pump.cancel()
            watcher.cancel()
            call.cancel()

    async def _loss_reason(self, item, models: set[str]) -> str | None:
        """Why a stream's upstream failed, when it was an instance lost (not the request's fault)."""
        if isinstance(item, StreamLost):
            return item.reason
        if item.code() == grpc.StatusCode.UNAVAILABLE:
            lost = any(k == UPSTREAM_LOST for k, _ in await _safe_trailing(item))
            return "a replica was lost with the stream open" if lost else (self._any_lost(models) or "upstream unavailable")
        # A stub that died mid-stream (the watchdog marks its model within a scan), or a replica
        # killed (serve-cluster marks it down): UNAVAILABLE, which clients retry, not INTERNAL.
        await asyncio.sleep(WATCHDOG_WAIT_S)
        return self._any_lost(models)

    def _any_lost(self, models: set[str]) -> str | None:
        for model in models:
            reason = self._lost_instance(model)
            if reason is not None:
                return reason
        return None

    async def unary_stream(self, method: str, request: bytes, context):
        call = self.channel.unary_stream(method)(request, metadata=self.metadata(context), timeout=self.timeout(context))
        try:
            async for response in call:
                yield response
        except aio.AioRpcError as exc:
            await self._abort_with(context, exc)

    async def stream_stream(self, method: str, request_iterator, context):
        call = self.channel.stream_stream(method)(
            request_iterator, metadata=self.metadata(context), timeout=self.timeout(context)
        )
        try:
            async for response in call:
                yield response
        except aio.AioRpcError as exc:
            await self._abort_with(context, exc)


def status_code(data: ErrorData) -> grpc.StatusCode:
    """The gRPC status of an error's code (contract.errors.GRPC_STATUS)."""
    return grpc.StatusCode[GRPC_STATUS[data.code].removeprefix("StatusCode.")]


def error_metadata(data: ErrorData) -> tuple[tuple[str, str], ...]:
    """An error's data as trailing metadata (``error-data``: one JSON object, contract.errors.data_json)."""
    return ((ERROR_METADATA, data_json(data)),)


async def abort_with_data(context, data: ErrorData) -> None:
    """End the call with ``data``: its code's status, its words as the details, the data as metadata."""
    await context.abort(status_code(data), data.message, error_metadata(data))


async def _safe_trailing(exc: aio.AioRpcError) -> tuple:
    try:
        return tuple(exc.trailing_metadata() or ())
    except Exception:
        return ()


class Handler(grpc.GenericRpcHandler):
    """Routes each method name to the door; unknown unary methods pass through as bytes."""

    def __init__(self, door: Door):
        self.door = door
        # Built once: service() runs for every call.
        self.special = {
            method: grpc.unary_unary_rpc_method_handler(fn)
            for method, fn in (
                (INFER, door.infer),
                (SERVER_READY, door.server_ready),
                (MODEL_READY, door.model_ready),
                (HEALTH_CHECK, door.health_check),
            )
        }
        self.special[STREAM] = grpc.stream_stream_rpc_method_handler(door.stream_infer)
        # serve-cluster and compose: nginx would take a load to one replica
        if door.starting_file is not None or door.replica_probes is not None:
            for method in (REPOSITORY_LOAD, REPOSITORY_UNLOAD):
                self.special[method] = grpc.unary_unary_rpc_method_handler(door.one_replica_only)

    def service(self, details):
        method = details.method
        door = self.door
        if method in self.special:
            return self.special[method]
        if method == HEALTH_WATCH:

            async def watch(request, context):
                async for response in door.unary_stream(method, request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(watch)

        # Every other method of GRPCInferenceService is unary (grpc.aio needs coroutine functions).
        async def passthrough(request, context):
            return await door.unary(method, request, context)

        return grpc.unary_unary_rpc_method_handler(passthrough)


def load_limits(repository: Path, max_message_bytes: int) -> Limits:
    from server.frontdoor import model_limits

    # Every element takes at least one byte of the message (BOOL, INT8, or a BYTES prefix's share).
    return Limits(models=model_limits(repository), max_elements=max_message_bytes)


async def serve(
    listen: str,
    upstream: str,
    repository: Path,
    health_dir: Path | None,
    max_message_bytes: int,
    ready_file: Path | None = None,
    drain_timeout: float = 30.0,
    starting_file: Path | None = None,
    healing_dirs: tuple[Path, ...] = (),
    replica_probes: tuple[str, ...] = (),
    stream_listen: str | None = None,
    stream_upstream: str | None = None,
) -> None:
    limits = load_limits(repository, max_message_bytes)
    door = Door(upstream, limits, health_dir, max_message_bytes, starting_file, healing_dirs)
    if replica_probes:
        door.replica_probes = ReplicaProbes(replica_probes).start()
    server = aio.server(
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=None,
    )
    server.add_generic_rpc_handlers((Handler(door),))
    if server.add_insecure_port(listen) == 0:
        raise SystemExit(f"grpc door: cannot listen on {listen}")
    await server.start()
    log.info("grpc door: %s -> %s (limits of %d models)", listen, upstream, len(limits.models))
    stream_runner = None
    if stream_listen is not None and stream_upstream is not None:
        from server import stream_door

        stream_runner = await stream_door.start(door, stream_listen, stream_upstream, max_message_bytes, drain_timeout)
    if ready_file is not None:
        ready_file.write_text(str(os.getpid()), encoding="utf-8")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum):
        # SIGTERM: refuse new calls, finish those in flight (at most drain_timeout), then exit.
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await stop.wait()
    # Both listeners drain at once, each for at most drain_timeout (the HTTP one's runner has it).
    drains = [server.stop(drain_timeout)]
    if stream_runner is not None:
        drains.append(stream_runner.cleanup())
    await asyncio.gather(*drains, return_exceptions=True)
    await door.channel.close()


def _address_argument(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return text


def _probe_argument(text: str) -> str:
    try:
        return probe_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--replica-probe {exc}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m server.grpc_door", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--listen", required=True, help="HOST:PORT to serve gRPC on (the public port)")
    p.add_argument("--upstream", required=True, help="HOST:PORT of the gRPC server behind (nginx's internal listener)")
    p.add_argument("--repository", type=Path, required=True, help="model repository whose configs give the limits")
    p.add_argument("--health-dir", type=Path, default=None, help="the watchdog's folder of unhealthy models")
    p.add_argument("--max-message-mb", type=int, default=64, help="larger messages get RESOURCE_EXHAUSTED (default 64)")
    p.add_argument("--ready-file", type=Path, default=None, help="written with the pid once listening")
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="on SIGTERM: seconds for calls in flight to finish (default 30)"
    )
    p.add_argument(
        "--replica-starting-file",
        type=Path,
        default=None,
        help="serve-cluster: while this file exists (a listed replica is not ready), NOT_FOUND for a "
        f"model of the repository is resent for up to {NOT_FOUND_WAIT_S:.0f} s",
    )
    p.add_argument(
        "--replica-probe",
        action="append",
        default=[],
        type=_probe_argument,
        metavar="URL",
        help="docker-compose: a replica's probe port readiness, e.g. http://triton-upstream-1:8003/v2/health/ready "
        f"(repeat per replica); while one is not 200, NOT_FOUND for a model of the repository is resent for up to "
        f"{NOT_FOUND_WAIT_S:.0f} s, and repository loads are refused (they would reach one replica)",
    )
    p.add_argument(
        "--healing-dir",
        type=Path,
        action="append",
        default=[],
        help="serve-cluster: a replica's watchdog folder (repeat per replica); an INTERNAL answer "
        "for a model marked there is resent",
    )
    p.add_argument(
        "--stream-listen",
        type=_address_argument,
        default=None,
        metavar="HOST:PORT",
        help="also serve Triton's HTTP generate_stream here, for the front door's nginx (server/stream_door.py): "
        "a stream whose stub or replica is lost is continued or ended at once; needs --stream-upstream",
    )
    p.add_argument(
        "--stream-upstream",
        type=_address_argument,
        default=None,
        metavar="HOST:PORT",
        help="the HTTP server behind --stream-listen: tritonserver's HTTP port, or nginx's internal stream listener",
    )
    args = p.parse_args(argv)
    if (args.stream_listen is None) != (args.stream_upstream is None):
        p.error("--stream-listen and --stream-upstream go together")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    asyncio.run(
        serve(
            args.listen,
            args.upstream,
            args.repository,
            args.health_dir,
            args.max_message_mb << 20,
            args.ready_file,
            args.drain_timeout,
            args.replica_starting_file,
            tuple(args.healing_dir),
            tuple(args.replica_probe),
            args.stream_listen,
            args.stream_upstream,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
