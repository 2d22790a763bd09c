"""``/v1/files``: upload (multipart ``file`` and ``purpose``), list, get, content and delete of
the Batch API's files (``openai_gateway/batch_store.py`` keeps them)."""

from __future__ import annotations

import asyncio
import mmap
import os
import re
import time
from pathlib import Path
from typing import Literal

import orjson
from fastapi import APIRouter, Query, Request, Security
from fastapi.responses import FileResponse

from openai_gateway.batch_store import BatchStore
from openai_gateway.batches import BatchRunner, check_upload, new_id
from openai_gateway.errors import APIError, bad_request
from openai_gateway.responses import json_response
from openai_gateway.routes import bearer

router = APIRouter()

# OpenAI's purposes; only "batch" is served here.
PURPOSES = ("batch", "assistants", "fine-tune", "vision", "user_data", "evals")
MULTIPART_OVERHEAD = 64 * 1024  # the form's other fields and headers, on top of the file's limit
WRITE_CHUNK = 1 << 20
_UPLOAD = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}
# What an id of this store looks like (file-<hex>, batch_<hex>, file-<hex>-output); anything else is unknown.
ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_BOUNDARY = re.compile(r'boundary="?([^";]{1,70})"?')
_FIELD = re.compile(rb'\bname="([^"]*)"(?:; *filename="([^"]*)")?', re.IGNORECASE)


def runner(request: Request) -> BatchRunner:
    """The app's batch runner (``app.py``)."""
    return request.app.state.batches


def store_of(request: Request) -> BatchStore:
    """The Batch API's store of the app serving ``request``."""
    return runner(request).store()


def check_id(value: str | None, param: str) -> None:
    """404 for a path id (400 for a cursor) that no object of the store can have."""
    if value is not None and not ID.match(value):
        raise (
            APIError(404, f"No such object: {value[:80]!r}", param=param)
            if param.endswith("_id")
            else bad_request(f"{param} must be an id of this list", param)
        )


def not_found(file_id: str) -> APIError:
    """404 for a file that does not exist."""
    return APIError(404, f"No such file: {file_id[:80]!r}", param="file_id", code="file_not_found")


def parse_form(path: Path, boundary: bytes) -> tuple[dict[str, str], tuple[int, int, str] | None]:
    """The text fields and the file part (start, end, filename) of the multipart body at ``path``."""
    fields: dict[str, str] = {}
    upload = None
    size = path.stat().st_size
    if size == 0:
        return fields, None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        delimiter, opening = b"\r\n--" + boundary, b"--" + boundary
        if mm[: len(opening)] == opening:
            pos = len(opening)
        else:  # a preamble before the first part
            pos = mm.find(delimiter)
            if pos < 0:
                return fields, None
            pos += len(delimiter)
        while mm[pos : pos + 2] == b"\r\n":
            head_end = mm.find(b"\r\n\r\n", pos + 2)
            end = mm.find(delimiter, head_end + 4) if head_end >= 0 else -1
            if end < 0:
                raise bad_request("the multipart body is truncated (a part has no end)", param="file")
            match = _FIELD.search(mm[pos + 2 : head_end])
            if match is not None:
                name = match.group(1).decode("utf-8", "replace")
                if match.group(2) is not None or name == "file":
                    upload = (head_end + 4, end, (match.group(2) or b"upload.jsonl").decode("utf-8", "replace"))
                elif end - head_end - 4 <= 256:
                    fields[name] = mm[head_end + 4 : end].decode("utf-8", "replace")
            pos = end + len(delimiter)
    return fields, upload


def _copy(src: Path, start: int, end: int, dest: Path) -> None:
    with open(src, "rb") as f, open(dest, "wb") as out:
        f.seek(start)
        left = end - start
        while left:
            chunk = f.read(min(left, 1 << 20))
            out.write(chunk)
            left -= len(chunk)
        out.flush()
        os.fsync(out.fileno())


@router.post("/v1/files", dependencies=[Security(bearer)], openapi_extra=_UPLOAD)
async def create_file(request: Request):
    """Upload a JSONL input file of the Batch API (``purpose`` batch): OpenAI's file object."""
    settings = runner(request).settings
    limit = settings.batch_max_file_bytes
    ctype = request.headers.get("content-type", "")
    found = _BOUNDARY.search(ctype)
    if not ctype.startswith("multipart/form-data") or found is None:
        raise bad_request("POST /v1/files takes multipart/form-data with the fields file and purpose", param="file")
    store = store_of(request)
    file_id = new_id("file-")
    body = store.files_dir / f"{file_id}.upload"
    try:
        received, pending, buffered = 0, list[bytes](), 0
        with open(body, "wb") as out:
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit + MULTIPART_OVERHEAD:
                    raise bad_request(f"file: the file exceeds {limit} bytes (--batch-max-file-mb)", param="file")
                pending.append(chunk)
                buffered += len(chunk)
                if buffered >= WRITE_CHUNK:  # written in a thread, a MiB at a time, off the event loop
                    await asyncio.to_thread(out.writelines, pending)
                    pending, buffered = [], 0
            await asyncio.to_thread(out.writelines, pending)
        fields, upload = await asyncio.to_thread(parse_form, body, found.group(1).encode("latin-1"))
        purpose = fields.get("purpose")
        if purpose is None:
            raise bad_request("purpose is required (batch)", param="purpose")
        if purpose not in PURPOSES:
            raise bad_request(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose[:40]!r}", param="purpose")
        if purpose != "batch":
            raise bad_request(f"purpose {purpose!r} is not served here: only batch files are", param="purpose")
        if upload is None:
            raise bad_request("file is required (a multipart part named file)", param="file")
        start, end, filename = upload
        if end - start > limit:
            raise bad_request(f"file: the file has {end - start} bytes; the limit is {limit} (--batch-max-file-mb)", param="file")
        dest = store.file_path(file_id)
        await asyncio.to_thread(_copy, body, start, end, dest)
        try:
            await asyncio.to_thread(check_upload, dest, settings.batch_max_lines)
        except APIError:
            dest.unlink(missing_ok=True)
            raise
    finally:
        body.unlink(missing_ok=True)
    obj = await asyncio.to_thread(store.add_file, file_id, purpose, filename[:255], end - start, int(time.time()))
    return json_response(200, orjson.dumps(obj))


@router.get("/v1/files", dependencies=[Security(bearer)])
async def list_files(
    request: Request,
    purpose: str | None = Query(None, max_length=64),
    limit: int = Query(10000, ge=1, le=10000),
    after: str | None = Query(None, max_length=128),
    order: Literal["asc", "desc"] = "desc",
):
    """The files, newest first (``order``), ``limit`` after the file ``after``."""
    check_id(after, "after")
    data, more = await asyncio.to_thread(store_of(request).list_files, purpose, after, limit, order == "desc")
    return json_response(200, orjson.dumps(cursor_page(data, more)))


@router.get("/v1/files/{file_id}", dependencies=[Security(bearer)])
async def get_file(file_id: str, request: Request):
    """OpenAI's file object of ``file_id``."""
    check_id(file_id, "file_id")
    obj = await asyncio.to_thread(store_of(request).get_file, file_id)
    if obj is None:
        raise not_found(file_id)
    return json_response(200, orjson.dumps(obj))


@router.get("/v1/files/{file_id}/content", dependencies=[Security(bearer)])
async def file_content(file_id: str, request: Request):
    """The bytes of ``file_id`` (JSONL)."""
    check_id(file_id, "file_id")
    store = store_of(request)
    obj = await asyncio.to_thread(store.get_file, file_id)
    if obj is None or not store.file_path(file_id).is_file():
        raise not_found(file_id)
    return FileResponse(store.file_path(file_id), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}", dependencies=[Security(bearer)])
async def delete_file(file_id: str, request: Request):
    """Delete ``file_id`` (refused while an unfinished batch reads it)."""
    check_id(file_id, "file_id")
    deleted = await asyncio.to_thread(store_of(request).delete_file, file_id)
    if isinstance(deleted, str):
        raise bad_request(f"file {file_id} is the input of batch {deleted}, which is not finished; cancel it first", "file_id")
    if not deleted:
        raise not_found(file_id)
    return json_response(200, orjson.dumps({"id": file_id, "object": "file", "deleted": True}))


def cursor_page(data: list[dict], more: bool) -> dict:
    """OpenAI's cursor page."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }
