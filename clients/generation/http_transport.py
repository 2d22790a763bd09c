"""HTTP: Triton's generate extension, ``POST .../generate`` (one JSON object) and
``.../generate_stream`` (Server-Sent Events, one ``data: {...}`` event per text piece).

One connection per request, closed to cancel it (the server sees the request cancelled). The
stream functions are one attempt on one endpoint and return ``(pieces, cancel)``.
"""

from __future__ import annotations

import http.client
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

from clients.generation.request import GenerateRequest, GenerationOptions
from clients.generation.response import (
    Generation,
    GenerationError,
    Piece,
    SSEDecoder,
    Tracker,
    http_error,
    piece_from_json,
    transport_error,
)

log = logging.getLogger(__name__)


def _connection(o: GenerationOptions, url: str | None = None, timeout_s: float | None = None) -> http.client.HTTPConnection:
    host, port = o.host_port(url)
    return http.client.HTTPConnection(host, port, timeout=timeout_s if timeout_s is not None else o.timeout_s)


def _post(
    o: GenerationOptions, conn: http.client.HTTPConnection, request: GenerateRequest, stream: bool
) -> http.client.HTTPResponse:
    log.debug("generate: %s via http %s:%s%s", o.model, conn.host, conn.port, o.http_path(stream))
    conn.request(
        "POST",
        o.http_path(stream),
        body=request.http_body(stream),
        headers={"Content-Type": "application/json", "Accept": "text/event-stream" if stream else "application/json"},
    )
    return conn.getresponse()


def _failure(o: GenerationOptions, response: http.client.HTTPResponse) -> GenerationError:
    body = response.read().decode("utf-8", "replace")
    return http_error(response.status, body, o.model)


def http_whole(
    o: GenerationOptions, request: GenerateRequest, url: str | None = None, timeout_s: float | None = None
) -> Generation:
    """Blocking: the whole answer from ``/generate`` (its arrival is the first token)."""
    url = url or o.url
    tracker = Tracker()
    conn = _connection(o, url, timeout_s)
    try:
        response = _post(o, conn, request, stream=False)
        if response.status != 200:
            raise _failure(o, response)
        tracker.add(piece_from_json(response.read().decode("utf-8", "replace"), o.model))
    except (OSError, http.client.HTTPException) as exc:
        raise transport_error(exc, "http", url, o.model, o.timeout_s) from exc
    finally:
        conn.close()
    generation = tracker.result()
    # One response: its arrival is the first token.
    return replace(generation, time_to_first_token_s=generation.total_time_s if generation.text else None)


def http_stream(o: GenerationOptions, request: GenerateRequest, url: str | None = None, first_timeout_s: float | None = None):
    """Blocking: the pieces of ``/generate_stream`` (http.client); cancelling closes the connection."""
    url = url or o.url
    conn = _connection(o, url, first_timeout_s)

    def pieces() -> Iterator[Piece]:
        try:
            response = _post(o, conn, request, stream=True)
            if response.status != 200:
                raise _failure(o, response)
            if conn.sock is not None and first_timeout_s is not None:
                conn.sock.settimeout(o.timeout_s)  # the first response's wait was the attempt's
            decoder = SSEDecoder()
            while True:
                chunk = response.read1(65536)
                events = decoder.feed(chunk) if chunk else decoder.close()
                for event in events:
                    yield piece_from_json(event, o.model)
                if not chunk:
                    return
        except (OSError, http.client.HTTPException) as exc:
            raise transport_error(exc, "http", url, o.model, o.timeout_s) from exc
        finally:
            conn.close()

    return pieces(), conn.close


def http_aio_stream(
    o: GenerationOptions,
    session: Any,
    request: GenerateRequest,
    stream: bool,
    url: str | None = None,
    first_timeout_s: float | None = None,
):
    """asyncio: the pieces of ``/generate_stream`` (or the one of ``/generate``) on a connection
    of ``session`` (aiohttp); cancelling closes that connection."""
    import aiohttp

    url = url or o.url
    held: dict[str, Any] = {}

    async def pieces() -> AsyncIterator[Piece]:
        log.debug("generate: %s via aiohttp %s%s", o.model, url, o.http_path(stream))
        connect = first_timeout_s if first_timeout_s is not None else o.timeout_s
        timeout = aiohttp.ClientTimeout(total=None, sock_read=o.timeout_s, sock_connect=connect)
        try:
            response = await session.post(
                o.http_path(stream), data=request.http_body(stream), timeout=timeout, headers={"Content-Type": "application/json"}
            )
            held["response"] = response
            try:
                if response.status != 200:
                    raise http_error(response.status, (await response.read()).decode("utf-8", "replace"), o.model)
                if not stream:
                    yield piece_from_json((await response.read()).decode("utf-8", "replace"), o.model)
                    return
                decoder = SSEDecoder()
                async for chunk in response.content.iter_any():
                    for event in decoder.feed(chunk):
                        yield piece_from_json(event, o.model)
                for event in decoder.close():
                    yield piece_from_json(event, o.model)
            finally:
                response.release()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise transport_error(exc, "http", url, o.model, o.timeout_s) from exc

    async def cancel() -> None:
        # close(), not release(): the connection must drop for the server to cancel.
        if "response" in held:
            held["response"].close()

    return pieces(), cancel
