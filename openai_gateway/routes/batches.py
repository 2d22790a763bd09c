"""``/v1/batches``: create (the input file checked line by line), get, list and cancel; the
gateway's batch runner (``openai_gateway/batches.py``) answers the lines."""

from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Query, Request, Security
from pydantic import BaseModel, ConfigDict, Field

from openai_gateway.batches import COMPLETION_WINDOWS, ENDPOINTS, check_lines, new_batch, new_id
from openai_gateway.errors import APIError, bad_request
from openai_gateway.responses import json_response
from openai_gateway.routes import bearer
from openai_gateway.routes.files import check_id, cursor_page, runner, store_of
from openai_gateway.state import request_info

router = APIRouter()


class BatchCreateRequest(BaseModel):
    """OpenAI's batch creation body (fields it adds later are ignored)."""

    model_config = ConfigDict(extra="ignore")
    input_file_id: str = Field(max_length=128)
    endpoint: str = Field(max_length=128)
    completion_window: str = Field(max_length=16)
    metadata: dict[str, str] | None = None


def not_found(batch_id: str) -> APIError:
    """404 for a batch that does not exist."""
    return APIError(404, f"No such batch: {batch_id[:80]!r}", param="batch_id", code="batch_not_found")


@router.post("/v1/batches", dependencies=[Security(bearer)])
async def create_batch(body: BatchCreateRequest, request: Request):
    """Create a batch of the lines of ``input_file_id``: ``validating`` until a runner takes it
    up, or ``failed`` with ``errors`` naming each bad line."""
    if body.completion_window not in COMPLETION_WINDOWS:
        raise bad_request(
            f"completion_window must be {', '.join(COMPLETION_WINDOWS)}, got {body.completion_window!r}", "completion_window"
        )
    if body.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}", "endpoint")
    metadata = body.metadata
    if metadata is not None and (len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())):
        raise bad_request("metadata holds at most 16 pairs, keys of at most 64 and values of at most 512 characters", "metadata")
    check_id(body.input_file_id, "input_file_id")
    store = store_of(request)
    gone = APIError(404, f"No such file: {body.input_file_id!r}", param="input_file_id", code="file_not_found")
    file = await asyncio.to_thread(store.get_file, body.input_file_id)
    if file is None:
        raise gone
    if file["purpose"] != "batch":
        raise bad_request(f"input_file_id must name a file of purpose batch, not {file['purpose']}", "input_file_id")
    settings = runner(request).settings
    try:
        total, errors = await asyncio.to_thread(check_lines, store.file_path(file["id"]), settings.batch_max_lines, body.endpoint)
    except FileNotFoundError:  # deleted since the lookup above
        raise gone from None
    batch = new_batch(new_id("batch_"), body.endpoint, file["id"], body.completion_window, metadata, total, errors)
    # Recorded only if the file still exists (one statement; a delete checks for batches in one too).
    if not await asyncio.to_thread(store.add_batch, batch, total, request_info(request)["key_id"]):
        raise gone
    return json_response(200, orjson.dumps(await asyncio.to_thread(store.get_batch, batch["id"])))


@router.get("/v1/batches", dependencies=[Security(bearer)])
async def list_batches(request: Request, after: str | None = Query(None, max_length=128), limit: int = Query(20, ge=1, le=100)):
    """The batches, newest first, ``limit`` after the batch ``after``."""
    check_id(after, "after")
    data, more = await asyncio.to_thread(store_of(request).list_batches, after, limit)
    return json_response(200, orjson.dumps(cursor_page(data, more)))


@router.get("/v1/batches/{batch_id}", dependencies=[Security(bearer)])
async def get_batch(batch_id: str, request: Request):
    """The batch, its ``request_counts`` as committed now."""
    check_id(batch_id, "batch_id")
    batch = await asyncio.to_thread(store_of(request).get_batch, batch_id)
    if batch is None:
        raise not_found(batch_id)
    return json_response(200, orjson.dumps(batch))


@router.post("/v1/batches/{batch_id}/cancel", dependencies=[Security(bearer)])
async def cancel_batch(batch_id: str, request: Request):
    """Cancel the batch: ``cancelling`` until its lines in flight end, then ``cancelled`` with the
    results committed so far in its output and error files."""
    check_id(batch_id, "batch_id")
    store = store_of(request)
    if not await asyncio.to_thread(store.transition, batch_id, "cancelling", ("validating", "in_progress")):
        batch = await asyncio.to_thread(store.get_batch, batch_id)
        if batch is None:
            raise not_found(batch_id)
        if batch["status"] not in ("cancelling", "cancelled"):
            raise bad_request(f"a batch that is {batch['status']} cannot be cancelled", "batch_id")
    return json_response(200, orjson.dumps(await asyncio.to_thread(store.get_batch, batch_id)))
