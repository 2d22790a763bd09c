"""Triton's HTTP ``generate_stream`` through the door: server-sent events that outlive a stub or a replica.

nginx cannot end a stream by itself: a decoupled model whose python backend stub dies leaves its
streams open in tritonserver 2.51 (no response will come, and none says so), so an HTTP client of
``.../generate_stream`` used to wait for its own timeout, or nginx's 600 s. The front door now
sends these streams here (``@triton_stream`` in deploy/frontdoor/nginx.conf.template), after its
own check of the body (``check.generate``). This listener runs in the gRPC door's process and
reads the same marks (``server.grpc_door.Door``): the launcher's watchdog folder, serve-cluster's
replica folders, docker-compose's probe ports. It passes the events on as tritonserver wrote them
(but a model's error, whose data it moves out of the words into the event's own keys:
``{"error": <words>, "code", "field", "values"}``, contract/errors.py) and, when the stream is lost
(a mark on its model, or the upstream connection cut by a replica's death):

- a continuable model (``server.stream_resume``: ``text_generation``) that has answered goes on:
  the request is sent again with the token ids its client got as ``prefix_token_ids``, and the
  client reads the rest of the answer, no error and no token twice (the door asks for the ids
  with ``return_token_ids`` and takes them out of the events where the client did not ask);
- any other stream ends at once with an error event naming the model and the reason, as
  tritonserver reports an error on a stream (``data: {"error": ..., "code": "unavailable", ...}``);
  a stream lost before any event answers 503 with ``Retry-After``, which clients retry.

Not continued, as on the gRPC door: answers with several choices (``index``) or log-probabilities.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import ClientConnectionResetError, ClientError, ClientSession, ClientTimeout, TCPConnector, web
from aiohttp.http_exceptions import HttpProcessingError

from contract.errors import MARK, UNAVAILABLE, ErrorData, error_body, parse_error, public_body
from contract.streams import ASK_INPUT, PREFIX_INPUT
from server.stream_resume import IDS_OUTPUT, NOT_CONTINUABLE_OUTPUTS

# The answer's end, asked for on every continuable request: an event of HTTP's generate_stream has
# no final flag (gRPC's triton_final_response), and a stream cut after its last event must not be
# sent again (it would be continued past its end, or refused).
REASON_INPUT, REASON_OUTPUT = "return_finish_reason", "finish_reason"

if TYPE_CHECKING:
    from server.grpc_door import Door

log = logging.getLogger("stream_door")

# How often an open stream's marks are read while it is silent; how long a stream must be silent
# while its model is marked on some replica (serve-cluster, compose) before it counts as lost.
WATCH_S = 0.25
# How long an error event with no data of the model's waits for the watchdog to mark the model (its
# scan interval, twice): a stub's death reaches the stream before the mark.
WATCHDOG_WAIT_S = 0.5
SILENT_STREAM_S = 1.0
# How long a lost stream is sent again (a model's reload takes 6-12 s), and the pause between sends.
RESUME_WAIT_S = 30.0
RESUME_BACKOFF_S = 0.05
EVENT_END = b"\n\n"
_MARK = MARK.encode()
# Bodies past this are sent on as they came, not parsed (a continuation's prefix is far smaller:
# the model refuses one of max_tokens_limit tokens or more), so one request cannot hold the loop
# that serves every gRPC call too.
MAX_CONTINUED_BODY_BYTES = 1 << 20
MAX_PREFIX_TOKENS = 65536
# Hop-by-hop and length headers are the server's own; the rest of tritonserver's go on.
_OWN_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"})


@dataclass(frozen=True)
class Lost:
    """The upstream stream ended without its end: why; ``resumable`` False where sending the
    request again cannot help (an event over the size limit)."""

    reason: str
    resumable: bool = True


_END = object()  # the upstream stream ended as it should


@dataclass
class Continuation:
    """One continuable request: its JSON body as the client sent it, and the ids its client got."""

    body: dict[str, Any]
    client_wants_ids: bool
    prefix: list[int]
    client_wants_reason: bool = False
    ids: list[int] = field(default_factory=list)
    events: int = 0
    resends: int = 0
    continuable: bool = True
    finished: bool = False  # an event carried the answer's finish_reason: nothing is left to continue

    @classmethod
    def of(cls, body: Any) -> Continuation | None:
        """The continuation of a checked ``generate_stream`` body, or None when it cannot be sent
        again: not a JSON object, ``return_token_ids`` set false, or a prefix that is not a list of
        ints. A flag may come as a top-level field (an input) or in ``parameters`` (a request
        parameter, which the model reads too); tritonserver refuses a name given both ways."""
        if not isinstance(body, dict) or not isinstance(body.get("parameters", {}), dict):
            return None
        asked = _flag(body, ASK_INPUT)
        if asked is not None and asked is not True:
            return None
        prefix = body.get(PREFIX_INPUT, [])
        if isinstance(prefix, int) and not isinstance(prefix, bool):
            prefix = [prefix]
        if not isinstance(prefix, list) or len(prefix) > MAX_PREFIX_TOKENS:
            return None
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prefix):
            return None
        reason = _flag(body, REASON_INPUT)
        if reason is not None and reason is not True:
            return None
        return cls(body, client_wants_ids=asked is not None, prefix=list(prefix), client_wants_reason=reason is not None)

    def request_body(self) -> bytes:
        """The body to send upstream: the client's, asking for the ids, after the ids sent so far."""
        body = dict(self.body)
        params = dict(body.get("parameters") or {})
        for name in (ASK_INPUT, REASON_INPUT):
            if name not in body:  # asked as a request parameter, unless the client made it an input
                params[name] = True
        body["parameters"] = params
        prefix = self.prefix + self.ids
        if prefix:
            body[PREFIX_INPUT] = prefix
        else:
            body.pop(PREFIX_INPUT, None)
        return orjson.dumps(body)

    def incoming(self, event: bytes) -> tuple[bytes, str | None]:
        """One upstream event: (the bytes to pass on, its error message or None). The ids it
        carries are kept, and taken out where the client did not ask for them."""
        if not event.startswith(b"data:"):
            return event, None
        try:
            data = orjson.loads(event[5:])
        except orjson.JSONDecodeError:
            return event, None
        if not isinstance(data, dict):
            return event, None
        if "error" in data:
            return event, str(data["error"])
        self.events += 1
        if any(name in data for name in NOT_CONTINUABLE_OUTPUTS):
            self.continuable = False
        changed = False
        if IDS_OUTPUT in data:
            ids = data[IDS_OUTPUT]
            self.ids.extend(ids if isinstance(ids, list) else [ids])
            if not self.client_wants_ids:
                del data[IDS_OUTPUT]
                changed = True
        if REASON_OUTPUT in data:
            reason = data[REASON_OUTPUT]
            self.finished = self.finished or any(
                isinstance(r, str) and r for r in (reason if isinstance(reason, list) else [reason])
            )
            if not self.client_wants_reason:
                del data[REASON_OUTPUT]
                changed = True
        return (b"data: " + orjson.dumps(data) + EVENT_END if changed else event), None

    def can_resume(self) -> bool:
        return self.continuable and self.events > 0


def _flag(body: dict[str, Any], name: str) -> Any:
    """A BOOL flag as the client gave it: an input (top level: true, [true]) or a request parameter
    (true, "true"); None when absent, True when set, anything else as it came."""
    value = body[name] if name in body else body.get("parameters", {}).get(name)
    if value is True or value == [True] or (isinstance(value, str) and value.lower() == "true"):
        return True
    return value


class StreamDoor:
    """The aiohttp application behind nginx's ``@triton_stream``; ``upstream``: HOST:PORT of
    tritonserver's HTTP port (the launcher) or of nginx's internal stream listener, which balances
    the replicas (serve-cluster, docker-compose)."""

    def __init__(self, door: Door, upstream: str, max_body_bytes: int):
        # max_body_bytes: the largest request body, and the largest event passed on
        self.door = door
        self.upstream = f"http://{upstream}"
        self.max_body_bytes = max_body_bytes
        self.session: ClientSession | None = None
        self.streams_resumed = 0
        self.streams_ended = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v2/models/{model}/generate_stream", self.generate_stream)
        app.router.add_post("/v2/models/{model}/versions/{version}/generate_stream", self.generate_stream)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app) -> None:
        self.session = ClientSession(
            connector=TCPConnector(limit=0, keepalive_timeout=60),
            timeout=ClientTimeout(total=None, sock_connect=5, sock_read=None),
            auto_decompress=False,
        )

    async def _close(self, app) -> None:
        if self.session is not None:
            await self.session.close()

    # -- the marks -----------------------------------------------------------------------------

    def _marked_loss(self, model: str, silent_s: float, resumable: bool) -> str | None:
        """Why an open stream of ``model`` is lost: its model marked by this server's watchdog, or
        (replicas behind nginx, and only for a stream that can go on elsewhere, as on the gRPC
        door) marked on some replica while the stream is silent: the mark may be another
        replica's, and a stream cut for it that cannot be continued would be lost for nothing."""
        door = self.door
        reason = door._healing(model)
        remote = door.healing_dirs or door.replica_probes is not None
        if reason is None and resumable and remote and silent_s >= SILENT_STREAM_S:
            reason = door._healing_anywhere(model)
        return reason

    async def _marked_soon(self, model: str) -> str | None:
        """Why ``model``'s instance is lost, waiting for the mark a stub's death brings: the
        watchdog's next scans, and with replicas behind nginx the probe ports' next polls."""
        door = self.door
        deadline = time.monotonic() + WATCHDOG_WAIT_S * (3 if door.healing_dirs or door.replica_probes else 1)
        while True:
            reason = door._lost_instance(model)
            if reason is not None or time.monotonic() >= deadline:
                return reason
            await asyncio.sleep(0.1)

    # -- one stream ----------------------------------------------------------------------------

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        raw = await request.read()
        plan = None
        if model in self.door.continuable and len(raw) <= MAX_CONTINUED_BODY_BYTES:
            try:
                plan = Continuation.of(orjson.loads(raw))
            except orjson.JSONDecodeError:
                plan = None
        state = _Client(request)
        lost_since: float | None = None
        attempts = 0
        after_loss = False
        while True:
            outcome = await self._one_call(model, request, raw if plan is None else plan.request_body(), plan, state, after_loss)
            if outcome is _END:
                return await state.finish()
            assert isinstance(outcome, Lost)
            now = time.monotonic()
            if state.progressed:  # the stream went on since its last loss: a new loss starts afresh
                lost_since, attempts = None, 0
            lost_since = now if lost_since is None else lost_since
            if plan is not None and plan.finished and outcome.resumable:
                return await state.finish()  # cut after its last event: the answer is whole
            if plan is not None and outcome.resumable and plan.can_resume() and now - lost_since < RESUME_WAIT_S:
                if attempts == 0 or state.progressed:
                    self.streams_resumed += 1
                    log.info(
                        "HTTP stream of %s lost (%s): continued on a new call after %d token(s) sent",
                        model,
                        outcome.reason,
                        len(plan.ids),
                    )
                state.progressed = False
                plan.resends += 1
                await asyncio.sleep(RESUME_BACKOFF_S * 2 ** min(attempts, 4))
                attempts += 1
                after_loss = self.door._healing_anywhere(model) is not None
                continue
            self.streams_ended += 1
            message = f"model {model} lost the instance serving this stream ({outcome.reason}): retry"
            return await state.fail(message)

    async def _one_call(
        self, model: str, request: web.Request, body: bytes, plan: Continuation | None, state: _Client, after_loss: bool
    ) -> object:
        """One upstream call, its events passed on: ``_END`` when it ended as it should (or with a
        model's own error, passed on), else ``Lost``."""
        assert self.session is not None
        url = self.upstream + request.path_qs
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        try:
            upstream = await self.session.post(url, data=body, headers=headers)
        except (ClientError, OSError) as exc:
            return Lost(f"upstream unreachable: {exc.__class__.__name__}")
        try:
            if upstream.status != 200:
                try:
                    text = await upstream.read()
                except (ClientError, OSError) as exc:
                    return Lost(f"the upstream answer was cut ({exc.__class__.__name__})")
                if plan is not None and plan.resends and parse_error(_error_of(text)) is None:
                    # sent again: tritonserver's own refusals while the model reloads (the dead
                    # instance, then "not ready") pass, within RESUME_WAIT_S; a model's own goes on
                    return Lost(f"sent again, answered {upstream.status}")
                return await state.relay_refusal(upstream, text)
            return await self._relay(model, upstream, plan, state, after_loss)
        finally:
            upstream.close()

    async def _relay(self, model: str, upstream, plan: Continuation | None, state: _Client, after_loss: bool) -> object:
        """The upstream's events to the client as they come (read here, no queue and no timer per
        event); a watcher task beside it reads the marks while the stream is silent and, on a loss,
        closes the upstream connection, which ends the read."""
        call = _Call()
        watcher = asyncio.ensure_future(self._watch(model, call, upstream, after_loss, plan))
        try:
            while True:
                try:
                    event = await upstream.content.readuntil(EVENT_END, max_size=self.max_body_bytes)
                except HttpProcessingError:
                    return Lost(f"an event of the answer is over {self.max_body_bytes} bytes", resumable=False)
                except (ClientError, OSError, asyncio.IncompleteReadError) as exc:
                    return call.lost or Lost(f"the upstream stream was cut ({exc.__class__.__name__})")
                if call.lost is not None:
                    return call.lost
                if not event:
                    return _END
                if not event.endswith(EVENT_END):
                    return Lost("the upstream stream was cut mid-event")
                call.last_event = time.monotonic()
                if plan is not None:
                    event, error = plan.incoming(event)
                    if error is not None and plan.can_resume() and parse_error(error) is None:
                        # tritonserver's own error for a request whose instance died, or for one sent
                        # again while its model reloads: the request goes on. A model's own error goes on.
                        reason = self.door._lost_instance(model)
                        if reason is None and plan.resends:
                            reason = f"sent again, answered: {error[:120]}"
                        elif reason is None:
                            reason = await self._marked_soon(model)
                        if reason is not None:
                            return Lost(reason)
                if not await state.write(upstream, event):
                    return _END  # the client went away: the upstream call is closed
        finally:
            watcher.cancel()

    async def _watch(self, model: str, call: _Call, upstream, after_loss: bool, plan: Continuation | None) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            if after_loss:  # until the model is reloaded wherever it was marked
                after_loss = self.door._healing_anywhere(model) is not None
                continue
            silent = time.monotonic() - call.last_event
            resumable = plan is not None and plan.can_resume()
            reason = self._marked_loss(model, silent, resumable) if silent >= WATCH_S else None
            if reason is not None:
                call.lost = Lost(reason)
                upstream.close()
                return


@dataclass
class _Call:
    """What the relay and its watcher share about one upstream call."""

    last_event: float = field(default_factory=time.monotonic)
    lost: Lost | None = None


class _Client:
    """The client's side of one stream: headers sent with the first event."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response: web.StreamResponse | None = None
        self.progressed = False  # an event reached the client since the last loss

    async def write(self, upstream, event: bytes) -> bool:
        """Pass one event on; False when the client has gone."""
        try:
            if self.response is None:
                self.response = web.StreamResponse(status=200)
                for name, value in upstream.headers.items():
                    if name.lower() not in _OWN_HEADERS:
                        self.response.headers[name] = value
                await self.response.prepare(self.request)
            await self.response.write(public_error(event))
        except (ClientConnectionResetError, ConnectionResetError):
            return False
        self.progressed = True
        return True

    async def relay_refusal(self, upstream, text: bytes) -> object:
        """tritonserver's refusal before the stream began: to the client as it came, a model's
        error with its data as the body's keys."""
        text = public_error(text)
        if self.response is not None:
            await self.response.write(text if text.startswith(b"data:") else b"data: " + text.strip() + EVENT_END)
            return _END
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _OWN_HEADERS}
        self.response = web.Response(status=upstream.status, body=text, headers=headers)
        return _END

    async def fail(self, message: str) -> web.StreamResponse:
        """The stream was lost and cannot go on: ``unavailable`` (retry), its data as the body's
        keys as in every error at this edge (contract/errors.py)."""
        body = error_body(ErrorData(UNAVAILABLE, None, {}, message))
        if self.response is None:
            return web.json_response(body, status=503, headers={"Retry-After": "1"})
        try:
            await self.response.write(b"data: " + orjson.dumps(body) + EVENT_END)
        except (ClientConnectionResetError, ConnectionResetError):
            return self.response
        return await self.finish()

    async def finish(self) -> web.StreamResponse:
        try:
            if self.response is None:  # an empty stream: what tritonserver answers for no event
                self.response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
                await self.response.prepare(self.request)
            if isinstance(self.response, web.Response) and not self.response.prepared:
                return self.response
            await self.response.write_eof()
        except (ClientConnectionResetError, ConnectionResetError):
            pass  # the client has gone
        assert self.response is not None  # set above before anything that can raise
        return self.response


def public_error(body: bytes) -> bytes:
    """tritonserver's error (a JSON body, or one event) as this public edge answers it: a model's
    error with its data taken out of the words into the body's own keys; anything else as it came."""
    if _MARK not in body:
        return body
    event = body.startswith(b"data:")
    try:
        obj = orjson.loads(body[5:] if event else body)
    except orjson.JSONDecodeError:
        return body
    public = public_body(obj) if isinstance(obj, dict) else None
    if public is None:
        return body
    return b"data: " + orjson.dumps(public) + EVENT_END if event else orjson.dumps(public)


def _error_of(body: bytes) -> str:
    """The message of tritonserver's refusal (``{"error": ...}``, as JSON or as an event)."""
    text = body[5:] if body.startswith(b"data:") else body
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")
    return str(data.get("error", "")) if isinstance(data, dict) else str(data)


STREAM_DOOR = web.AppKey("stream_door", StreamDoor)


async def start(door: Door, listen: str, upstream: str, max_body_bytes: int, drain_timeout: float = 30.0) -> web.AppRunner:
    """Serve the stream door on ``listen`` (HOST:PORT) in the running loop; the runner to clean up
    (its application holds the ``StreamDoor`` under ``STREAM_DOOR``)."""
    host, _, port = listen.rpartition(":")
    stream_door = StreamDoor(door, upstream, max_body_bytes)
    app = stream_door.app()
    app[STREAM_DOOR] = stream_door
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_timeout)
    await runner.setup()
    await web.TCPSite(runner, host, int(port), reuse_address=True).start()
    log.info("stream door: %s -> %s", listen, upstream)
    return runner
