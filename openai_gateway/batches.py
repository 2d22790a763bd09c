"""OpenAI's Batch API on the gateway: the checks of an input file, and the runner that answers
its lines through the gateway's own routes, in process, and commits each result.

A line runs as an ASGI request to the app below its gate (no key, rate limit or access line: the
batch's key was checked when it was created), so its answer is byte for byte what the same
request sent directly gets. Lines go to the bulk priority class (docs/priority-classes.md): the
generation engine's for chat and completions, the model's bulk entry for ``/v1/embeddings`` where
it serves one; every line waits for one of ``--batch-concurrency``
slots, so a batch never holds more of the server than that. A 429 or 503 (the bulk lane at its
admission limit, Triton busy) is retried with backoff before it counts as failed.

Exactly once: a line's result is committed (``batch_store.py``) before it counts; a runner that
starts (again, after a restart or a lease takeover) skips the lines already committed, so only
the lines that were in flight when a gateway died run a second time, and the output holds each
``custom_id`` once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel, ValidationError

from openai_gateway.batch_store import BatchStore
from openai_gateway.errors import APIError
from openai_gateway.gate import RequestGate
from openai_gateway.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

if TYPE_CHECKING:
    from fastapi import FastAPI

    from openai_gateway.settings import GatewaySettings
    from openai_gateway.state import GatewayState

log = logging.getLogger("openai_gateway.batches")

# The endpoints a batch line may call, and the schema its body is checked against at creation.
ENDPOINTS: dict[str, type[BaseModel]] = {
    "/v1/embeddings": EmbeddingRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
COMPLETION_WINDOWS = {"24h": 24 * 3600}
STATUSES = ("validating", "in_progress", "finalizing", "cancelling", "completed", "failed", "cancelled", "expired")
MAX_ERRORS = 100  # errors listed on a failed batch
RETRY_STATUSES = (429, 503)
RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
# A batch whose run raises (its input unreadable, the store failing) is retried after these
# delays, then made failed with the error (RUN_ATTEMPTS runs in all, per gateway).
RUN_RETRY_S = (1.0, 4.0, 15.0, 60.0)
RUN_ATTEMPTS = len(RUN_RETRY_S) + 1
CLOSE_WAIT_S = 10.0  # how long close() waits for the runs to stop
READ_CHUNK = 1 << 20  # bytes of input lines read per call in a thread


def line_error(line: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """One entry of a failed batch's ``errors.data`` (OpenAI's shape)."""
    return {"code": code, "line": line, "message": message, "param": param}


def check_lines(path: Path, max_lines: int, endpoint: str | None) -> tuple[int, list[dict[str, Any]]]:
    """The lines of the JSONL file at ``path`` and what is wrong with them (up to ``MAX_ERRORS``).

    Each line must be a JSON object. With ``endpoint`` (at batch creation) each also needs a
    ``custom_id`` unique in the file, ``method`` POST, ``url`` equal to ``endpoint`` and a
    ``body`` that the endpoint's schema accepts, without streaming. Blank lines are skipped."""
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    count = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if len(errors) >= MAX_ERRORS:
                break
            if not raw.strip():
                continue
            count += 1
            if count > max_lines:
                errors.append(line_error(n, "too_many_tasks", f"the file has more than {max_lines} lines (--batch-max-lines)"))
                break
            try:
                item = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                errors.append(line_error(n, "invalid_json_line", f"line {n} is not valid JSON: {exc}"))
                continue
            if not isinstance(item, dict):
                errors.append(line_error(n, "invalid_json_line", f"line {n} is not a JSON object"))
                continue
            if endpoint is not None:
                error = _check_request(n, item, endpoint, seen)
                if error is not None:
                    errors.append(error)
    if count == 0 and not errors:
        errors.append(line_error(1, "empty_file", "the file has no lines"))
    return count, errors


def _check_request(n: int, item: dict, endpoint: str, seen: set[str]) -> dict[str, Any] | None:
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        return line_error(n, "invalid_custom_id", f"line {n}: custom_id must be a string of 1 to 512 characters", "custom_id")
    if custom_id in seen:
        return line_error(n, "duplicate_custom_id", f"line {n}: custom_id {custom_id!r} is not unique in the file", "custom_id")
    seen.add(custom_id)
    if item.get("method") != "POST":
        return line_error(n, "invalid_method", f"line {n}: method must be POST", "method")
    url = item.get("url")
    if url != endpoint:
        return line_error(n, "mismatched_endpoint", f"line {n}: url must be the batch's endpoint {endpoint}", "url")
    body = item.get("body")
    if not isinstance(body, dict):
        return line_error(n, "invalid_request", f"line {n}: body must be a JSON object", "body")
    try:
        request = ENDPOINTS[endpoint].model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = f"body.{where}" if where else "body"
        return line_error(n, "invalid_request", f"line {n}: {param}: {first['msg']}", param)
    if getattr(request, "stream", False):
        return line_error(n, "invalid_request", f"line {n}: a batch line cannot stream", "body.stream")
    return None


def check_upload(path: Path, max_lines: int) -> None:
    """400 naming ``file`` and the line when a batch input file is not JSONL or has too many lines."""
    _, errors = check_lines(path, max_lines, None)
    if errors:
        first = errors[0]
        raise APIError(400, first["message"], param="file", code=first["code"])


def new_batch(
    batch_id: str, endpoint: str, input_file_id: str, window: str, metadata: dict | None, total: int, errors: list
) -> dict[str, Any]:
    """A new batch object: ``validating`` (a runner takes it up), or ``failed`` with the line errors."""
    now = int(time.time())
    batch: dict[str, Any] = {
        "id": batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": "failed" if errors else "validating",
        "created_at": now,
        "expires_at": now + COMPLETION_WINDOWS[window],
        "request_counts": {"total": total, "completed": 0, "failed": 0},
        "metadata": metadata,
    }
    if errors:
        batch["errors"] = {"object": "list", "data": errors}
        batch["failed_at"] = now
    return batch


class BatchRunner:
    """Runs the batches of the store whose lease this gateway holds (one asyncio task each)."""

    def __init__(self, app: FastAPI, settings: GatewaySettings):
        self.app = app
        self.settings = settings
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._store: BatchStore | None = None
        self._inner: Any = None
        self._loop_task: asyncio.Task | None = None
        self._running: dict[str, asyncio.Task] = {}
        self._failures: dict[str, int] = {}  # failed runs of a batch, and when it is tried again
        self._retry_at: dict[str, float] = {}
        self._opening = threading.Lock()
        self._slots: asyncio.Semaphore | None = None
        self.poll_s = 1.0

    @property
    def state(self) -> GatewayState:
        return self.app.state.gateway

    def store(self) -> BatchStore:
        """The store, opened (and its folder created) on first use."""
        with self._opening:  # the poll opens it in a thread, a route on the event loop
            if self._store is None:
                self._store = BatchStore(self.settings.batch_dir)
            return self._store

    async def start(self) -> None:
        """Start polling the store for batches to run (the app's startup)."""
        self._slots = asyncio.Semaphore(self.settings.batch_concurrency)
        self._loop_task = asyncio.create_task(self._poll())

    async def close(self) -> None:
        """Stop the runs (cancelled, awaited up to ``CLOSE_WAIT_S``); lines in flight are not
        committed and run again where the batch resumes. Then the leases are given up, so another
        gateway (or this one restarted) resumes at once, and the store is closed."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait((self._loop_task,))
        held = list(self._running)
        tasks = list(self._running.values())
        for t in tasks:
            t.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
            if pending:
                log.warning("%d batch runs did not stop within %.0f s of shutdown", len(pending), CLOSE_WAIT_S)
        store, self._store = self._store, None
        if store is not None:

            def release() -> None:
                for batch_id in held:
                    store.release_lease(self.owner, batch_id)
                store.close()

            await asyncio.to_thread(release)

    async def _poll(self) -> None:
        # A gateway that never saw a batch creates no store: it waits for one to appear.
        while True:
            try:
                if self._store is not None or (self.settings.batch_dir / "store.sqlite3").exists():
                    store = await asyncio.to_thread(self.store)
                    now = time.time()
                    for batch_id in await asyncio.to_thread(store.take_leases, self.owner, self.settings.batch_lease_s, 16):
                        if batch_id not in self._running and self._retry_at.get(batch_id, 0) <= now:
                            self._running[batch_id] = asyncio.create_task(self._run(batch_id))
                    counts = await asyncio.to_thread(store.status_counts)
                    for status in STATUSES:
                        self.state.metrics.batches.labels(status).set(counts.get(status, 0))
            except Exception:
                log.exception("batch poll failed")
            await asyncio.sleep(self.poll_s)

    async def _run(self, batch_id: str) -> None:
        """Drive ``batch_id`` while holding its lease; stop when the lease is lost."""
        store = self.store()
        work = asyncio.create_task(self._drive(batch_id))
        try:
            while not work.done():
                await asyncio.wait((work,), timeout=self.settings.batch_lease_s / 3)
                if not work.done() and not await asyncio.to_thread(
                    store.renew_lease, self.owner, batch_id, self.settings.batch_lease_s
                ):
                    log.warning("batch %s: its lease was taken over; stopping here", batch_id)
                    work.cancel()
            await work
            self._failures.pop(batch_id, None)
            self._retry_at.pop(batch_id, None)
        except asyncio.CancelledError:
            work.cancel()
            await asyncio.wait((work,))  # its lines stopped before the store closes
            raise
        except Exception as exc:
            await self._failed(batch_id, exc)
        finally:
            self._running.pop(batch_id, None)

    async def _failed(self, batch_id: str, exc: Exception) -> None:
        """Count a failed run of ``batch_id``: tried again after a delay, or, after
        ``RUN_ATTEMPTS`` runs, made failed with the error in ``errors.data``."""
        n = self._failures.get(batch_id, 0) + 1
        if n < RUN_ATTEMPTS:
            self._failures[batch_id] = n
            delay = RUN_RETRY_S[n - 1]
            self._retry_at[batch_id] = time.time() + delay
            log.warning(
                "batch %s failed to run (%s: %s); run %d of %d in %.0f s",
                batch_id,
                type(exc).__name__,
                exc,
                n + 1,
                RUN_ATTEMPTS,
                delay,
            )
            return
        self._failures.pop(batch_id, None)
        self._retry_at.pop(batch_id, None)
        log.error("batch %s failed to run %d times; it is failed", batch_id, n, exc_info=exc)
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)  # no server path
        message = f"The batch failed to run {n} times: {type(exc).__name__}: {detail}"
        error = {"code": "batch_run_failed", "line": None, "message": message[:1000], "param": None}
        try:
            await asyncio.to_thread(self.store().fail, batch_id, self.owner, error)
        except Exception:
            log.exception("batch %s: its failure could not be recorded; run again at the next poll", batch_id)

    async def _drive(self, batch_id: str) -> None:
        store = self.store()
        batch = await asyncio.to_thread(store.get_batch, batch_id)
        if batch is None:
            return
        if batch["status"] == "validating" and await asyncio.to_thread(
            store.transition, batch_id, "in_progress", ("validating",)
        ):
            batch["status"] = "in_progress"
        if batch["status"] == "in_progress":
            await self._run_lines(batch)
            batch = await asyncio.to_thread(store.get_batch, batch_id)
            assert batch is not None
        if batch["status"] == "in_progress":
            expired = time.time() > batch["expires_at"]
            if not expired:
                await asyncio.to_thread(store.transition, batch_id, "finalizing", ("in_progress",))
            await self._finalize(batch, "expired" if expired else "completed")
        elif batch["status"] == "finalizing":
            await self._finalize(batch, "completed")
        elif batch["status"] == "cancelling":
            await self._finalize(batch, "cancelled")

    async def _run_lines(self, batch: dict) -> None:
        """Run every line of ``batch`` not committed yet; stop (the lines in flight too, which
        are not committed) once the batch is being cancelled, from any gateway, or its window
        has passed."""
        store, batch_id = self.store(), batch["id"]
        feed = asyncio.create_task(self._feed(batch))
        try:
            while not feed.done():
                await asyncio.wait((feed,), timeout=0.5)
                row = None if feed.done() else await asyncio.to_thread(store.batch_row, batch_id)
                if row is not None and (row[0] != "in_progress" or time.time() > batch["expires_at"]):
                    feed.cancel()
            # The feed's own cancel (above) ends the lines; a cancel of this task (shutdown, a lost
            # lease) propagates from the wait.
            await asyncio.wait((feed,))
            if not feed.cancelled():
                feed.result()
        finally:
            if not feed.done():
                feed.cancel()
                await asyncio.wait((feed,))

    async def _feed(self, batch: dict) -> None:
        """Start a task per line not committed, each in one of ``--batch-concurrency`` slots;
        none once the batch's window has passed (the rest expire)."""
        store, batch_id = self.store(), batch["id"]
        slots = self._slots
        assert slots is not None
        done = await asyncio.to_thread(store.done_lines, batch_id)
        row = await asyncio.to_thread(store.batch_row, batch_id)
        key_id = row[2] if row is not None else "batch"
        tasks: set[asyncio.Task] = set()
        try:
            async with contextlib.aclosing(_read_lines(store.file_path(batch["input_file_id"]))) as lines:
                async for n, raw in lines:
                    if n in done or not raw.strip():
                        continue
                    await slots.acquire()
                    if time.time() > batch["expires_at"]:
                        slots.release()
                        break
                    task = asyncio.create_task(self._line(batch_id, batch["endpoint"], n, orjson.loads(raw), key_id))
                    task.add_done_callback(lambda _: slots.release())
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _line(self, batch_id: str, endpoint: str, n: int, item: dict, key_id: str) -> None:
        store = self.store()
        await asyncio.to_thread(store.start_attempt, batch_id, n)
        for delay in (*RETRY_DELAYS_S, None):
            status, body, request_id = await self.call(item["url"], item["body"], key_id)
            if status not in RETRY_STATUSES or delay is None:
                break
            await asyncio.sleep(delay)
        record = {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": item["custom_id"],
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None,
        }
        ok = 200 <= status < 300
        if await asyncio.to_thread(store.add_result, batch_id, n, ok, orjson.dumps(record)):
            self.state.metrics.batch_lines.labels(endpoint, "completed" if ok else "failed").inc()

    async def call(self, url: str, body: Any, key_id: str) -> tuple[int, Any, str]:
        """POST ``body`` to the route ``url`` of this gateway in process: (status, JSON answer, request id)."""
        if self._inner is None:
            node: Any = self.app.build_middleware_stack()
            while not isinstance(node, RequestGate):  # each middleware wraps the next as .app
                node = node.app
            self._inner = node.app
        request_id = uuid.uuid4().hex
        headers = [(b"content-type", b"application/json")]
        if url != "/v1/embeddings" or self._bulk_served(body):  # generation: the engine's bulk class
            headers.append((b"x-priority-class", b"bulk"))
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": url,
            "raw_path": url.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": headers,
            "client": ("batch", 0),
            "server": ("batch", 0),
            "state": {"gateway": {"request_id": request_id, "key_id": key_id}},
            "app": self.app,
        }
        payload = orjson.dumps(body)
        received = asyncio.Event()
        status = [0]
        chunks: list[bytes] = []

        async def receive():
            if not received.is_set():
                received.set()
                return {"type": "http.request", "body": payload, "more_body": False}
            await asyncio.Event().wait()  # no disconnect: the batch waits for its answer

        async def send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await self._inner(scope, receive, send)
            return status[0], orjson.loads(b"".join(chunks)), request_id
        except Exception:
            log.exception("batch request %s failed", request_id)
            return 500, APIError(500, f"Internal error (request id {request_id})").body(), request_id

    def _bulk_served(self, body: Any) -> bool:
        """Whether the embedding model of ``body`` has a bulk class entry that Triton has ready."""
        st = self.state
        model = st.catalog.find(str(body.get("model")), "embedding") if isinstance(body, dict) else None
        if model is None or not any(cls == "bulk" for cls, _, _ in model.lanes):
            return False
        return all(name in st.backend.ready_models for name in model.entries("bulk"))

    async def _finalize(self, batch: dict, final: str) -> None:
        """Write the output and error files of ``batch`` and give it its final status. Run again
        after a crash, it writes the same files under the same ids."""
        store, batch_id = self.store(), batch["id"]
        key = batch_id.removeprefix("batch_")
        outputs = (("output_file_id", f"file-{key}-output", "output"), ("error_file_id", f"file-{key}-errors", "errors"))
        expired_from = store.file_path(batch["input_file_id"]) if final == "expired" else None
        # Written under names of this writer's own, moved in place by the store only while the lease is held.
        written = [store.files_dir / f"{file_id}.{uuid.uuid4().hex}.tmp" for _, file_id, _ in outputs]
        try:
            sizes = await asyncio.to_thread(_write_files, store.result_rows(batch_id), expired_from, *written)
            files = [
                (field, file_id, f"{batch_id}_{suffix}.jsonl", size, path)
                for (field, file_id, suffix), size, path in zip(outputs, sizes, written)
                if size
            ]
            done = await asyncio.to_thread(
                store.finalize, batch_id, self.owner, final, ("in_progress", "finalizing", "cancelling"), files
            )
        finally:
            for path in written:
                path.unlink(missing_ok=True)
        if done:
            log.info("batch %s %s", batch_id, final)
        else:
            log.warning(
                "batch %s: its lease was taken over (or it ended) while finalising; its files are left to the holder", batch_id
            )


async def _read_lines(path: Path) -> AsyncGenerator[tuple[int, bytes], None]:
    """(number, line) of the file at ``path``, read in a thread about a MiB at a time."""
    with open(path, "rb") as f:
        n = 0
        while lines := await asyncio.to_thread(f.readlines, READ_CHUNK):
            for raw in lines:
                n += 1
                yield n, raw


class _JSONL:
    """A JSONL file written to ``path`` and synced, kept if it has a record (and was written to
    the end)."""

    def __init__(self, path: Path):
        self.path, self.size = path, 0
        self.file = open(path, "wb")

    def write(self, record: bytes) -> None:
        self.file.write(record + b"\n")
        self.size += len(record) + 1

    def close(self, complete: bool) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if not (self.size and complete):
            self.path.unlink()
            self.size = 0


def _write_files(
    rows: Iterator[tuple[int, bool, bytes]], expired_from: Path | None, output: Path, errors: Path
) -> tuple[int, int]:
    """The output and error files of one read of the results (``rows``); with ``expired_from``
    (the input of an expired batch), each line without a result in that read is in the error file
    as batch_expired. One read: a line committed after it is left out (or expired), never listed
    twice. Their sizes."""
    out, err = _JSONL(output), _JSONL(errors)
    complete = False
    try:
        seen = set()
        for n, ok, record in rows:
            seen.add(n)
            (out if ok else err).write(record)
        if expired_from is not None:
            for record in _expired_records(expired_from, seen):
                err.write(record)
        complete = True
    finally:
        out.close(complete)
        err.close(complete)
    return out.size, err.size


def _expired_records(path: Path, done: set[int]) -> Iterator[bytes]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n in done or not raw.strip():
                continue
            record = {
                "id": f"batch_req_{uuid.uuid4().hex}",
                "custom_id": orjson.loads(raw)["custom_id"],
                "response": None,
                "error": {
                    "code": "batch_expired",
                    "message": "This request could not be executed before the completion window expired.",
                },
            }
            yield orjson.dumps(record)


def new_id(prefix: str) -> str:
    """A new object id (``file-...``, ``batch_...``)."""
    return f"{prefix}{uuid.uuid4().hex}"
