"""The checks every request passes before a route: request id, body size (413), API key (401),
rate limit (429); and, after it, the access log line and the request metrics.

A pure ASGI middleware, so a refused request costs no body read and no routing.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson
from starlette.exceptions import HTTPException as StarletteHTTPException

from openai_gateway.auth import ANONYMOUS
from openai_gateway.errors import APIError
from openai_gateway.ratelimit import RateLimiterUnavailable
from openai_gateway.responses import error_response

if TYPE_CHECKING:
    from openai_gateway.state import GatewayState

access_log = logging.getLogger("openai_gateway.access")

# The route label of the metrics; anything else is "other" (so a scan cannot grow the label set).
ROUTES = (
    "/v1/embeddings",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/models",
    "/v1/files",
    "/v1/batches",
    "/tokenize",
    "/detokenize",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/score",
    "/v1/score",
    "/health",
    "/health/ready",
    "/metrics",
    "/openapi.json",
    "/docs",
)
# Routes outside /v1 that need a key as the /v1 ones do (vLLM's paths).
KEYED = ("/tokenize", "/detokenize", "/rerank", "/v2/rerank", "/score")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def route_label(path: str) -> str:
    """The metrics' ``route`` label of a request path."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith(("/v1/files/", "/v1/batches/")):
        return "/v1/files/{file_id}" if path.startswith("/v1/files/") else "/v1/batches/{batch_id}"
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{response_id}"
    return "other"


class RequestGate:
    """Pure ASGI middleware: request id, body limit, API key, rate limit, log line, metrics."""

    def __init__(self, app, state: GatewayState):
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
        route = route_label(path)
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
            if path.startswith("/v1/") or path in KEYED:
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
            if path == "/v1/files":  # a batch input file: its own limit, checked by the route
                limit = max(limit, st.settings.batch_max_file_bytes + (1 << 20))
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                await refuse(
                    APIError(
                        413,
                        f"the request body has {length.decode('latin-1')} bytes; the limit is {limit} (--max-body-mb)",
                        code="request_too_large",
                    )
                )
                return
            seen = [0]

            async def receive_limited():
                message = await receive()
                if message["type"] == "http.request":
                    seen[0] += len(message.get("body", b""))
                    if seen[0] > limit:
                        raise BodyTooLarge(limit)
                return message

            try:
                await self.app(scope, receive_limited, send_wrapped)
            except BodyTooLarge as exc:  # read outside a route (inside one, on_http_error answers)
                if status_box[0] == 0:
                    await refuse(APIError(413, exc.detail, code="request_too_large"))
        finally:
            st.metrics.in_flight.dec()
            elapsed = time.perf_counter() - started
            status = status_box[0] or 499
            st.metrics.observe(route, status, elapsed)
            if st.settings.log_requests:
                line = {
                    "request_id": request_id,
                    "key_id": info["key_id"],
                    "method": scope["method"],
                    "path": path,
                    "status": status,
                    "ms": round(elapsed * 1000, 2),
                }
                for k in ("model", "prompt_tokens", "completion_tokens", "error", "texts"):
                    if k in info:
                        line[k] = info[k]
                access_log.info(orjson.dumps(line).decode("utf-8"))

    async def _check(self, headers: dict, info: dict) -> APIError | None:
        st = self.state
        auth = headers.get(b"authorization")
        kid = st.keys.check(auth.decode("latin-1") if auth is not None else None)
        if kid is None:
            return APIError(
                401,
                "Missing or invalid API key: send `Authorization: Bearer <key>` "
                "(keys: $GATEWAY_API_KEYS or the gateway's key file)",
                code="invalid_api_key",
            )
        info["key_id"] = kid
        try:
            retry = st.limiter.check(kid)
            if not isinstance(retry, int):  # the shared limiter asks Redis
                retry = await retry
        except RateLimiterUnavailable as exc:
            return APIError(
                503, f"{exc}; retry later", code="rate_limiter_unavailable", type="server_error", headers={"Retry-After": "1"}
            )
        finally:
            errors = getattr(st.limiter, "redis_errors", 0)
            if errors > st.redis_errors_seen:
                st.metrics.rate_limit_redis_errors.inc(errors - st.redis_errors_seen)
                st.redis_errors_seen = errors
        if retry:
            st.metrics.rate_limited.labels(kid).inc()
            return APIError(
                429,
                f"Rate limit reached for this key: {st.limiter.rate:g} requests/s, bursts of "
                f"{st.limiter.burst}; retry after {retry} s",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(retry)},
            )
        return None


class BodyTooLarge(StarletteHTTPException):
    """Raised while the body is read. An HTTPException, because FastAPI turns any other
    exception from its body parsing into a generic 400; this one reaches on_http_error as 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body exceeds {limit} bytes (--max-body-mb)")
