"""The ASGI app: routes, the checks every request passes first, errors in OpenAI's shape.

Order of a ``/v1`` request: request id, body size (413), API key (401), rate limit (429) in
one ASGI middleware before the body is read; then the schema (422) and the request checks
(400/413, naming the field and the limit); then readiness (503); then Triton. Every request
ends in one log line and in the metrics, whatever its status.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPBearer
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from openai_gateway import completions, embeddings
from openai_gateway.auth import ANONYMOUS, ApiKeys
from openai_gateway.catalog import Catalog, EmbeddingModel, GenerationModel
from openai_gateway.errors import APIError, model_not_found
from openai_gateway.metrics import GatewayMetrics
from openai_gateway.ratelimit import RateLimiter, RateLimiterUnavailable, SharedRateLimiter
from openai_gateway.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from openai_gateway.settings import GatewaySettings
from openai_gateway.triton import TritonBackend

log = logging.getLogger("openai_gateway")
access_log = logging.getLogger("openai_gateway.access")

# Picks the priority class's entry models for /v1/embeddings (docs/priority-classes.md).
PRIORITY_HEADER = "X-Priority-Class"
ROUTES = ("/v1/embeddings", "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/health/ready",
          "/metrics", "/openapi.json", "/docs")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
JSON = "application/json"


class EventStream(StreamingResponse):
    """SSE that closes its iterator however the response ends (a client gone mid-stream
    included), so the generation's Triton request is cancelled at once, not at garbage collection."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


class ClientGone(Exception):
    """The client disconnected before its answer; its Triton work was cancelled."""


def _route(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


def _json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status_code=status, media_type=JSON, headers=headers)


def error_response(err: APIError) -> Response:
    return _json_response(err.status, err.json(), err.headers)


class RequestGate:
    """Pure ASGI middleware: request id, body limit, API key, rate limit, log line, metrics."""

    def __init__(self, app, state: "GatewayState"):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st = self.state
        started = time.perf_counter()
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        info: dict[str, Any] = {"request_id": request_id, "key_id": ANONYMOUS}
        scope.setdefault("state", {})["gateway"] = info
        path = scope["path"]
        route = _route(path)
        status_box = [0]
        id_header = (b"x-request-id", request_id.encode("ascii"))

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
                message["headers"] = [*message.get("headers", []), id_header]
            await send(message)

        async def refuse(err: APIError):
            info["error"] = err.type
            response = error_response(err)
            await response(scope, receive, send_wrapped)

        st.metrics.in_flight.inc()
        try:
            if path.startswith("/v1/"):
                ctype = headers.get(b"content-type", b"")
                if scope["method"] == "POST" and (not ctype or ctype.startswith(b"application/x-www-form-urlencoded")):
                    # curl -d sends a form content type: the body is JSON all the same.
                    scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                    scope["headers"].append((b"content-type", b"application/json"))
                err = await self._check(headers, info)
                if err is not None:
                    await refuse(err)
                    return
            limit = st.settings.max_body_bytes
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                await refuse(APIError(413, f"the request body has {length.decode('latin-1')} bytes; the limit is "
                                      f"{limit} (--max-body-mb)", code="request_too_large"))
                return
            seen = [0]

            async def receive_limited():
                message = await receive()
                if message["type"] == "http.request":
                    seen[0] += len(message.get("body", b""))
                    if seen[0] > limit:
                        raise _BodyTooLarge(limit)
                return message

            try:
                await self.app(scope, receive_limited, send_wrapped)
            except _BodyTooLarge as exc:  # read outside a route (inside one, on_http_error answers)
                if status_box[0] == 0:
                    await refuse(APIError(413, exc.detail, code="request_too_large"))
        finally:
            st.metrics.in_flight.dec()
            elapsed = time.perf_counter() - started
            status = status_box[0] or 499
            st.metrics.observe(route, status, elapsed)
            if st.settings.log_requests:
                line = {"request_id": request_id, "key_id": info["key_id"], "method": scope["method"], "path": path,
                        "status": status, "ms": round(elapsed * 1000, 2)}
                for k in ("model", "prompt_tokens", "completion_tokens", "error", "texts"):
                    if k in info:
                        line[k] = info[k]
                access_log.info(orjson.dumps(line).decode("utf-8"))

    async def _check(self, headers: dict, info: dict) -> APIError | None:
        st = self.state
        auth = headers.get(b"authorization")
        kid = st.keys.check(auth.decode("latin-1") if auth is not None else None)
        if kid is None:
            return APIError(401, "Missing or invalid API key: send `Authorization: Bearer <key>` "
                            "(keys: $GATEWAY_API_KEYS or the gateway's key file)", code="invalid_api_key")
        info["key_id"] = kid
        try:
            retry = st.limiter.check(kid)
            if not isinstance(retry, int):  # the shared limiter asks Redis
                retry = await retry
        except RateLimiterUnavailable as exc:
            return APIError(503, f"{exc}; retry later", code="rate_limiter_unavailable", type="server_error",
                            headers={"Retry-After": "1"})
        finally:
            errors = getattr(st.limiter, "redis_errors", 0)
            if errors > st.redis_errors_seen:
                st.metrics.rate_limit_redis_errors.inc(errors - st.redis_errors_seen)
                st.redis_errors_seen = errors
        if retry:
            st.metrics.rate_limited.labels(kid).inc()
            return APIError(429, f"Rate limit reached for this key: {st.limiter.rate:g} requests/s, bursts of "
                            f"{st.limiter.burst}; retry after {retry} s", code="rate_limit_exceeded",
                            headers={"Retry-After": str(retry)})
        return None


class _BodyTooLarge(StarletteHTTPException):
    """Raised while the body is read. An HTTPException, because FastAPI turns any other
    exception from its body parsing into a generic 400; this one reaches on_http_error as 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body exceeds {limit} bytes (--max-body-mb)")


class GatewayState:
    def __init__(self, settings: GatewaySettings, keys: ApiKeys, catalog: Catalog | None = None):
        self.settings = settings
        self.keys = keys
        self.catalog = catalog or Catalog.from_repository(settings.model_repository, settings.embedding_entry)
        self.metrics = GatewayMetrics()
        if settings.rate_limit_redis_url and settings.rate_limit_rps > 0:
            # One bucket per key for every gateway behind the front door (serve-cluster's Redis).
            self.limiter = SharedRateLimiter(settings.rate_limit_redis_url, settings.rate_limit_rps,
                                             settings.rate_limit_burst, fail=settings.rate_limit_fail)
        else:
            self.limiter = RateLimiter(settings.rate_limit_rps, settings.rate_limit_burst)
        self.redis_errors_seen = 0
        self.backend = TritonBackend(settings.triton_url, self.catalog, settings.triton_timeout_s,
                                     settings.generation_timeout_s, settings.ready_poll_s,
                                     coalesce=settings.coalesce_embeddings,
                                     coalesce_max_rows=settings.coalesce_max_rows,
                                     health_dir=settings.triton_health_dir)
        self.counters: dict[str, embeddings.TokenCounter] = {}
        for m in self.catalog.of_kind("embedding"):
            try:
                self.counters[m.id] = embeddings.TokenCounter(m.tokenizer_file)
            except FileNotFoundError as exc:
                log.warning("%s is not served by the gateway: %s", m.id, exc)


def priority_class_of(request: Request, model: EmbeddingModel) -> str | None:
    """The request's X-Priority-Class (docs/priority-classes.md), None when absent; 400 for a
    class the model has no entry for."""
    value = request.headers.get(PRIORITY_HEADER)
    if value is None:
        return None
    value = value.strip().lower()
    served = [cls for cls, _, _ in model.lanes] or ["default"]
    if value not in served:
        raise APIError(400, f"{PRIORITY_HEADER} must be one of {', '.join(served)} for {model.id}, got {value[:40]!r}",
                       param=PRIORITY_HEADER, code="invalid_priority_class")
    return None if value == "default" else value


def _info(request: Request) -> dict[str, Any]:
    return request.scope["state"]["gateway"]


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_done_or_gone(request: Request, coro, metrics: GatewayMetrics, route: str):
    """Await ``coro``; if the client disconnects first, cancel it (and its Triton calls)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself cancelled (shutdown): the work goes with it
        work.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    metrics.cancelled.labels(route).inc()
    raise ClientGone()


def create_app(settings: GatewaySettings, keys: ApiKeys, catalog: Catalog | None = None) -> FastAPI:
    state = GatewayState(settings, keys, catalog)
    backend, metrics = state.backend, state.metrics
    backend.on_batch = metrics.coalesced.observe

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        try:
            yield
        finally:
            await backend.close()
            if isinstance(state.limiter, SharedRateLimiter):
                await state.limiter.close()

    app = FastAPI(title="OpenAI-compatible gateway to Triton", version="1",
                  description="OpenAI's embeddings, chat completions, completions and models endpoints over the "
                  "Triton models of this repository. Every /v1 route needs `Authorization: Bearer <key>`.",
                  lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.gateway = state
    bearer = HTTPBearer(auto_error=False, description="An API key of the gateway")

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        _info(request)["error"] = exc.type
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            err = APIError(400, f"The body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
                           code="invalid_json")
        else:
            param = ".".join(loc) or None
            details = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                                for e in errors[:5])
            err = APIError(422, f"Invalid request: {details}", param=param, code="invalid_request")
        _info(request)["error"] = err.type
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"Unknown path {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        err = APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                       code="request_too_large" if exc.status_code == 413 else None)
        return error_response(err)

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, exc: ClientGone):
        _info(request)["error"] = "client_disconnected"
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        info = _info(request)
        log.exception("request %s failed", info.get("request_id"))
        info["error"] = "server_error"
        return error_response(APIError(500, f"Internal error (request id {info.get('request_id')})"))

    # --- health and metrics ------------------------------------------------------------

    @app.get("/health", include_in_schema=False)
    async def health():
        return _json_response(200, b'{"status":"ok"}')

    @app.get("/health/ready", include_in_schema=False)
    async def health_ready():
        served = [m.id for m in backend.served()]
        metrics.triton_ready.set(1 if backend.server_ready and served else 0)
        if not backend.server_ready:
            return error_response(APIError(503, f"Triton at {settings.triton_url} is not ready",
                                           code="triton_unavailable", headers={"Retry-After": "1"}))
        if not served:
            return error_response(APIError(503, "no model is ready in Triton", code="triton_unavailable",
                                           headers={"Retry-After": "1"}))
        return _json_response(200, orjson.dumps({"status": "ready", "models": served}))

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        metrics.triton_ready.set(1 if backend.server_ready else 0)
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- models --------------------------------------------------------------------------

    def model_object(m) -> dict:
        return {"id": m.id, "object": "model", "created": 0, "owned_by": "triton", "aliases": list(m.aliases),
                "kind": m.kind}

    def servable() -> list:
        """Ready in Triton, and (embeddings) with the tokenizer the gateway counts tokens with."""
        return [m for m in backend.served() if not isinstance(m, EmbeddingModel) or m.id in state.counters]

    @app.get("/v1/models", dependencies=[Security(bearer)])
    async def list_models():
        if not backend.server_ready:
            raise APIError(503, "Triton is not ready yet", code="triton_unavailable", headers={"Retry-After": "1"})
        return _json_response(200, orjson.dumps({"object": "list", "data": [model_object(m) for m in servable()]}))

    @app.get("/v1/models/{model:path}", dependencies=[Security(bearer)])
    async def get_model(model: str):
        if not backend.server_ready:  # as /v1/models: not "does not exist" while Triton is down
            raise APIError(503, "Triton is not ready yet", code="triton_unavailable", headers={"Retry-After": "1"})
        found = next((m for m in servable() if model == m.id or model in m.aliases), None)
        if found is None:
            raise APIError(404, f"The model {model!r} does not exist or is not served", param="model",
                           code="model_not_found")
        return _json_response(200, orjson.dumps(model_object(found)))

    def find(name: str, kind: str):
        model = state.catalog.find(name, kind)
        if model is None or (kind == "embedding" and model.id not in state.counters):
            served = [m.id for m in state.catalog.of_kind(kind)]
            raise model_not_found(name, kind, served)
        return model

    # --- embeddings ----------------------------------------------------------------------

    # The hot route parses and validates its body itself, in one pass (pydantic-core reads the
    # JSON bytes), instead of through FastAPI's body machinery; the schema is still published.
    embedding_body = {"requestBody": {"required": True, "content": {JSON: {"schema": EmbeddingRequest.model_json_schema()}}},
                      "security": [{"HTTPBearer": []}]}

    @app.post("/v1/embeddings", openapi_extra=embedding_body)
    async def create_embeddings(request: Request):
        try:
            body = EmbeddingRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        info = _info(request)
        model: EmbeddingModel = find(body.model, "embedding")
        info["model"] = model.id
        counter = state.counters[model.id]
        if isinstance(body.input, list) and len(body.input) > 64:
            job = await asyncio.to_thread(embeddings.check_request, body, model, counter, settings)
        else:
            job = embeddings.check_request(body, model, counter, settings)
        info["texts"] = job.size
        info["prompt_tokens"] = job.prompt_tokens
        job.priority_class = priority_class_of(request, model)
        backend.require_ready(model)
        if job.priority_class is not None:
            backend.require_entry_ready(model, job.priority_class)
        work = backend.embed(job, info["request_id"], counter.pad_id)
        # One batch is over in milliseconds: watching for a disconnect would cost more than it saves.
        vectors = await (work if len(job.chunks()) == 1 else until_done_or_gone(request, work, metrics, "/v1/embeddings"))
        metrics.count_tokens(info["key_id"], model.id, job.prompt_tokens)
        return _json_response(200, embeddings.response_body(job, vectors))

    # --- generation ----------------------------------------------------------------------

    async def generation(request: Request, job: completions.GenerationJob, route: str):
        info = _info(request)
        info["model"] = job.model.id
        backend.require_ready(job.model)
        started = time.perf_counter()
        # The first piece before the status: errors the engine finds at admission (context too
        # long, queue full) get their own status instead of a 200 that fails.
        pieces = backend.generate(job, info["request_id"])
        try:
            first = await until_done_or_gone(request, anext(pieces, None), metrics, route)
        except APIError as exc:
            fitted = completions.fit_to_context(job, exc)
            if fitted is None:
                raise
            job = fitted  # no max_tokens given: the rest of the context, as OpenAI does
            pieces = backend.generate(job, info["request_id"])
            first = await until_done_or_gone(request, anext(pieces, None), metrics, route)
        if first is not None and (first.text or first.final):
            metrics.ttft.labels(job.model.id).observe(time.perf_counter() - started)
        if not job.stream:
            async def whole():
                text, tally = [], completions.Tally()
                piece = first
                while piece is not None:  # an empty final response may follow the answer
                    text.append(piece.text)
                    tally.add(piece)
                    piece = None if piece.final else await anext(pieces, None)
                return "".join(text), tally

            text, tally = await until_done_or_gone(request, whole(), metrics, route)
            _count(info, job, tally)
            return _json_response(200, completions.whole_body(job, text, tally.reason, tally.prompt_tokens,
                                                              tally.completion_tokens))
        return EventStream(_sse(request, job, first, pieces, info), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _sse(request: Request, job, first, pieces: AsyncIterator, info: dict) -> AsyncIterator[bytes]:
        writer = completions.ChunkWriter(job)
        tally = completions.Tally()
        completed = False
        try:
            head = writer.start()
            if head:
                yield head
            piece = first
            while piece is not None:
                if piece.text:
                    yield writer.text(piece.text)
                tally.add(piece)
                if piece.final:
                    break
                piece = await anext(pieces, None)
            completed = True
            yield writer.finish(tally.reason, tally.prompt_tokens, tally.completion_tokens)
        except APIError as exc:
            info["error"] = exc.type
            yield writer.error(exc.body())
        finally:
            if not completed and "error" not in info:
                info["error"] = "client_disconnected"
                metrics.cancelled.labels(_route(request.url.path)).inc()
            await pieces.aclose()
            _count(info, job, tally)

    def _count(info: dict, job, tally: completions.Tally) -> None:
        info["prompt_tokens"], info["completion_tokens"] = tally.prompt_tokens, tally.completion_tokens
        metrics.count_tokens(info["key_id"], job.model.id, tally.prompt_tokens, tally.completion_tokens)

    @app.post("/v1/chat/completions", dependencies=[Security(bearer)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model: GenerationModel = find(body.model, "generation")
        return await generation(request, completions.check_chat(body, model, settings), "/v1/chat/completions")

    @app.post("/v1/completions", dependencies=[Security(bearer)])
    async def text_completions(body: CompletionRequest, request: Request):
        model: GenerationModel = find(body.model, "generation")
        return await generation(request, completions.check_completion(body, model, settings), "/v1/completions")

    app.add_middleware(RequestGate, state=state)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id", PRIORITY_HEADER],
                           expose_headers=["X-Request-Id", "Retry-After"])
    return app
