"""``/v1/responses`` (OpenAI's Responses API) on the generation model, whole or streamed as typed
events; ``GET``, ``DELETE`` and ``/input_items`` of a stored response."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Query, Request, Security

from openai_gateway.catalog import GenerationModel
from openai_gateway.completions import GenerationJob, Tallies
from openai_gateway.errors import APIError, unavailable
from openai_gateway.response_store import StoreUnavailable, dumps
from openai_gateway.responses import json_response
from openai_gateway.responses_api import ResponsesRequest, ResponseWriter, check_response, not_found
from openai_gateway.routes import bearer
from openai_gateway.routes.completions import with_priority_class
from openai_gateway.state import GatewayState, gateway_state, request_info
from openai_gateway.streaming import EventStream, record_usage, until_done_or_gone

log = logging.getLogger("openai_gateway")
router = APIRouter()
ROUTE = "/v1/responses"


async def _stored(st: GatewayState, response_id: str, param: str | None = None) -> dict[str, Any]:
    try:
        record = await st.responses.get(response_id)
    except StoreUnavailable as exc:
        raise unavailable(str(exc)) from exc
    if record is None:
        raise not_found(response_id, param)
    return record


async def _keep(st: GatewayState, writer: ResponseWriter, items: list[dict[str, Any]]) -> None:
    """Store a finished response with the items it was generated from (``store: true``). A store
    that fails loses the record, not the answer: logged, and the response says ``store: false``."""
    if not writer.response["store"]:
        return
    try:
        await st.responses.put(writer.response["id"], {"response": writer.response, "input": items})
    except StoreUnavailable as exc:
        log.warning("response %s not stored: %s", writer.response["id"], exc)
        writer.response["store"] = False


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + dumps(e) + b"\n\n" for e in events)


@router.post(ROUTE, dependencies=[Security(bearer)])
async def create_response(body: ResponsesRequest, request: Request):
    """Answer the input items (and a stored response's, with previous_response_id) as OpenAI's
    Response object, or its typed events with ``stream: true``."""
    st = gateway_state(request)
    model: GenerationModel = st.find(body.model, "generation")
    context: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = await _stored(st, body.previous_response_id, "previous_response_id")
        context = previous["input"] + previous["response"]["output"]
    job, items = check_response(body, context, model, st.settings)
    with_priority_class(request, job)
    info = request_info(request)
    info["model"] = job.model.id
    st.backend.require_ready(job.model)
    started = time.perf_counter()
    pieces = st.backend.generate(job, info["request_id"])
    # The status waits for the first piece, so admission errors (context too long) get their own.
    first = await until_done_or_gone(request, anext(pieces, None), st.metrics, ROUTE)
    if first is not None and (first.text or first.final):
        st.metrics.ttft.labels(job.model.id).observe(time.perf_counter() - started)
    writer = ResponseWriter(job, body)
    if not body.stream:

        async def whole() -> Tallies:
            tallies = Tallies()
            piece = first
            while piece is not None:
                tallies.add(piece)
                writer.feed(piece.text, piece.logprobs)
                piece = None if piece.final else await anext(pieces, None)
            return tallies

        tallies = await until_done_or_gone(request, whole(), st.metrics, ROUTE)
        record_usage(info, job, tallies, st.metrics)
        writer.finish(tallies)
        await _keep(st, writer, items)
        return json_response(200, dumps(writer.response))
    return EventStream(
        _events(request, st, job, writer, items, first, pieces, info),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _events(
    request: Request,
    st: GatewayState,
    job: GenerationJob,
    writer: ResponseWriter,
    items: list[dict[str, Any]],
    first,
    pieces: AsyncGenerator,
    info: dict,
) -> AsyncGenerator[bytes, None]:
    """The typed events of a streamed response; the response is stored before its last event,
    so a client may chain it as soon as it has read it."""
    tallies = Tallies()
    completed = False
    try:
        yield _sse(writer.start())
        piece = first
        while piece is not None:
            tallies.add(piece)
            events = writer.feed(piece.text, piece.logprobs)
            if events:
                yield _sse(events)
            if piece.final:
                break
            piece = await anext(pieces, None)
        completed = True
        last = writer.finish(tallies)
        await _keep(st, writer, items)
        last[-1]["response"]["store"] = writer.response["store"]
        yield _sse(last)
    except APIError as exc:
        info["error"] = exc.type
        yield _sse(writer.fail(exc))
    finally:
        if not completed and "error" not in info:
            info["error"] = "client_disconnected"
            st.metrics.cancelled.labels(ROUTE).inc()
        await pieces.aclose()
        record_usage(info, job, tallies, st.metrics)


@router.get(ROUTE + "/{response_id}", dependencies=[Security(bearer)])
async def retrieve_response(response_id: str, request: Request):
    """A stored response; 404 naming the id when there is none (never stored, expired, deleted)."""
    record = await _stored(gateway_state(request), response_id)
    return json_response(200, dumps(record["response"]))


@router.delete(ROUTE + "/{response_id}", dependencies=[Security(bearer)])
async def delete_response(response_id: str, request: Request):
    """Delete a stored response: OpenAI's deleted object; 404 naming the id when there is none."""
    try:
        deleted = await gateway_state(request).responses.delete(response_id)
    except StoreUnavailable as exc:
        raise unavailable(str(exc)) from exc
    if not deleted:
        raise not_found(response_id)
    return json_response(200, orjson.dumps({"id": response_id, "object": "response", "deleted": True}))


@router.get(ROUTE + "/{response_id}/input_items", dependencies=[Security(bearer)])
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
):
    """The input items a stored response was generated from (its chain's included), as OpenAI's list."""
    items = (await _stored(gateway_state(request), response_id))["input"]
    items = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise APIError(400, f"after: no input item {after[:80]!r} in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    body = {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(items) > limit,
    }
    return json_response(200, dumps(body))
