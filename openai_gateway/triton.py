"""Triton over one shared gRPC channel (``tritonclient.grpc.aio``): readiness, embeddings,
generation streams, each call with a deadline, each error mapped to an HTTP status.

A background task polls the readiness of Triton and of each model once a second, so a
request checks a flag instead of making a call; until Triton and a model's Triton models
are ready, requests to that model get 503.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from contract.errors import CONTEXT_LENGTH, INVALID, error_data, words_of
from contract.prose import triton_unavailable
from contract.truncation import DIRECTION_INPUT, RIGHT, TRUNCATE_INPUT
from openai_gateway.catalog import Catalog, EmbeddingModel, Model, RerankerModel
from openai_gateway.completions import GenerationJob
from openai_gateway.embeddings import EmbeddingJob, context_length_error, pad_ids
from openai_gateway.errors import APIError, unavailable

log = logging.getLogger(__name__)

_STATUS = {
    "StatusCode.INVALID_ARGUMENT": 400,
    "StatusCode.UNAVAILABLE": 503,
    "StatusCode.DEADLINE_EXCEEDED": 504,
    "StatusCode.CANCELLED": 499,
    "StatusCode.NOT_FOUND": 503,
    "StatusCode.RESOURCE_EXHAUSTED": 413,
}
_LENGTH = struct.Struct("<I")  # the length prefix of each element of a BYTES tensor
_WIRE_DTYPES = {"FP32": "<f4", "INT32": "<i4"}  # raw output contents are little-endian
# The text entries' output beside EMBEDDING: each text's token count (the tokenizer step's).
TOKEN_COUNT_OUTPUT = "NUM_TOKENS"


@dataclass(frozen=True)
class Piece:
    """One response of a generation stream."""

    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    final: bool
    cached_tokens: int | None = None
    logprobs: list[dict] | None = None  # OpenAI's token objects of this piece's text, when asked
    index: int = 0  # the choice (n > 1)
    token_ids: tuple[int, ...] = ()  # asked when the stream can be continued (TritonBackend.generate)
    prompt_logprobs: list[dict | None] | None = None  # the prompt's entries (echo with logprobs), first piece only
    structure_fitted: bool = False  # fit_structure_to_max_tokens steered the answer (its final piece)

    @classmethod
    def of(cls, result) -> Piece:
        """A piece of one decoupled gRPC response."""
        from clients.generation import is_final, piece_from_result

        p = piece_from_result(result)
        return cls(
            p.text,
            p.finish_reason,
            p.num_input_tokens,
            p.num_output_tokens,
            is_final(result),
            p.num_cached_tokens,
            p.logprobs,
            p.index,
            p.token_ids,
            p.prompt_logprobs,
            structure_fitted=_fitted(result),
        )


def _fitted(result) -> bool:
    array = result.as_numpy("structure_fitted")
    return array is not None and bool(array.any())


def triton_error(exc: Exception, what: str, param_map: dict[str, str] | None = None) -> APIError:
    """An APIError for a failed Triton call: 4xx for what the request did, 5xx for Triton.

    The models' errors carry their code, field and values as data (contract/errors.py), read by
    contract.errors.error_data wherever the hop put it (after the words from tritonserver, the
    ``error-data`` metadata from the gRPC door), which decide the status and the OpenAI ``param``
    (the model's input names mapped to the request's fields by ``param_map``) on a unary call and
    on a stream alike. Triton's own errors carry a gRPC status; a stream error of Triton's own
    has neither (502). ``exc``: tritonclient's InferenceServerException (``status()``,
    ``message()``; a stream's has no status) or a grpc.RpcError (``code()``, ``details()``)."""
    status_name = str(_call(exc, "status") or _call(exc, "code") or "")
    text = _call(exc, "message") or _call(exc, "details") or str(exc)
    data = error_data(exc)
    message = words_of(str(text))
    if data is not None:
        status = data.http_status
        if status == 500:
            status = 502  # the model failed: a bad gateway to the client
    elif status_name:
        status = _STATUS.get(status_name, 502)
    else:  # a stream error of Triton's own (its words): a model it cannot reach now is a 503
        status = 503 if triton_unavailable(message) else 502
    if status == 503:
        return unavailable(f"{what}: Triton cannot take the request now: {message}")
    if status == 504:
        return APIError(504, f"{what}: no answer from Triton within the deadline: {message}", code="timeout")
    if status == 499:
        return APIError(499, f"{what}: cancelled", code="cancelled")
    if status >= 500:
        return APIError(502, f"{what}: Triton failed: {message}", code="triton_error")
    param = None
    if data is not None and data.field:
        base, bracket, index = data.field.partition("[")  # TEXT[3] -> input[3]
        param = (param_map or {}).get(base, base) + bracket + index
    code = None if data is None or data.code == INVALID else data.code
    if status == 413:
        return APIError(413, message, param=param, code=code, data=data)
    return APIError(400, message, param=param, code=code, data=data)


def _call(exc: Exception, name: str) -> Any:
    method = getattr(exc, name, None)
    return method() if callable(method) else None


class TritonBackend:
    """The gateway's side of Triton: one gRPC channel, the models' readiness polled in the
    background, embeddings (coalesced) and generation streams."""

    def __init__(
        self,
        url: str,
        catalog: Catalog,
        timeout_s: float,
        generation_timeout_s: float,
        poll_s: float = 1.0,
        coalesce: bool = True,
        coalesce_max_rows: int = 16,
        health_dir: Path | None = None,
    ):
        self.url = url
        # The launcher's stub watchdog folder: a file per model whose instance died (server/stubs.py).
        self.health_dir = health_dir
        self.catalog = catalog
        self.timeout_s = timeout_s
        self.generation_timeout_s = generation_timeout_s
        self.poll_s = poll_s
        self.client: Any = None  # tritonclient.grpc.aio's InferenceServerClient (untyped) once started
        self.server_ready = False  # Triton answers (live); each model's readiness in ready_models
        self._missed_polls = 0
        self.ready_models: frozenset[str] = frozenset()
        self._monitor: asyncio.Task | None = None
        self.coalesce = coalesce
        if coalesce_max_rows < 1:
            raise ValueError(f"coalesce_max_rows must be >= 1, got {coalesce_max_rows}")
        self.coalesce_max_rows = coalesce_max_rows
        self._coalescers: dict[tuple[str, str | None], Coalescer] = {}
        self.on_batch = lambda requests: None  # each coalesced Triton request: how many it carried
        self.streams_resumed = 0  # generation streams continued after Triton lost them

    async def start(self) -> None:
        """Open the channel and start polling readiness (inside the running loop)."""
        import tritonclient.grpc.aio as grpcclient

        self.client = grpcclient.InferenceServerClient(self.url)
        self._monitor = asyncio.create_task(self._watch(), name="triton-readiness")

    async def close(self) -> None:
        """Stop polling and close the channel."""
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    async def refresh(self) -> None:
        """Poll Triton's liveness and each served model's readiness once."""
        # Readiness of each model, not the repository index: the index is behind the
        # repository API's token, which the gateway does not need otherwise.
        names = sorted(
            {n for m in self.catalog.models.values() for n in self.catalog.triton_models(m)}
            | {n for m in self.catalog.of_kind("embedding") for lane in m.lanes for n in lane[1:]}
        )
        # Liveness, then each model's own readiness: tritonserver's server readiness is false
        # while any model loads or unloads (strict readiness), which says nothing of the models
        # the gateway serves (a router unloaded beside them turned every request into a 503).
        try:
            ready = await self.client.is_server_live(client_timeout=2.0)
            states = await asyncio.gather(*(self.client.is_model_ready(n, client_timeout=2.0) for n in names)) if ready else []
            self._missed_polls = 0
        except Exception as exc:  # Triton down or starting: not ready, logged once per change
            self._missed_polls += 1
            if self.server_ready and self._missed_polls < 2:
                return  # one slow poll on a busy machine is not a dead server; the next one decides
            if self.server_ready:
                log.warning("Triton at %s is not answering: %s", self.url, exc)
            ready, states = False, []
        models = frozenset(n for n, ok in zip(names, states) if ok)
        if ready != self.server_ready or models != self.ready_models:
            log.info(
                "Triton at %s %s; models ready: %s",
                self.url,
                "is ready" if ready else "is not ready",
                ", ".join(sorted(models)) or "none",
            )
        self.server_ready, self.ready_models = ready, models

    async def _watch(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.poll_s)

    def is_ready(self, model: Model) -> bool:
        """Whether Triton and every model ``model`` reaches are ready."""
        return self.server_ready and all(name in self.ready_models for name in self.catalog.triton_models(model))

    def served(self, kind: str | None = None) -> list[Model]:
        """The models (of ``kind``) ready to serve now."""
        return [m for m in self.catalog.models.values() if (kind is None or m.kind == kind) and self.is_ready(m)]

    def require_entry_ready(self, model: EmbeddingModel, priority_class: str) -> None:
        """503 when the class's entry models are not loaded and ready in Triton."""
        missing = [n for n in model.entries(priority_class) if n not in self.ready_models]
        if missing:
            raise unavailable(
                f"{model.id}: priority class {priority_class!r} is not served now (not ready: {', '.join(missing)})"
            )

    def require_ready(self, model: Model) -> None:
        """503 unless Triton and every model ``model`` reaches are ready."""
        if not self.server_ready:
            raise unavailable("Triton is not ready yet (starting, or down); retry shortly")
        if not self.is_ready(model):
            missing = [n for n in self.catalog.triton_models(model) if n not in self.ready_models]
            raise unavailable(f"{model.id} is not ready in Triton (not ready: {', '.join(missing)})")

    # --- embeddings ----------------------------------------------------------------------

    async def _infer(
        self,
        model_name: str,
        tensors: list[tuple[str, str, tuple[int, ...], bytes]],
        outputs: tuple[tuple[str, str], ...],
        request_id: str,
        param_map: dict[str, str] | None = None,
    ) -> list[np.ndarray]:
        """One ModelInfer call with raw tensor contents, built straight into the protobuf
        (tritonclient's InferInput/InferResult copy and convert each tensor once more: a
        quarter of the gateway's CPU per cached embedding), on the client's own channel.
        ``outputs``: (name, datatype) of each output asked for; their arrays, in that order.
        ``param_map``: the model's input names as the request's fields (default TEXT -> input)."""
        import grpc
        from tritonclient.grpc import service_pb2

        request = service_pb2.ModelInferRequest(model_name=model_name, id=request_id)
        for name, datatype, shape, raw in tensors:
            t = request.inputs.add()
            t.name, t.datatype = name, datatype
            t.shape.extend(shape)
            request.raw_input_contents.append(raw)
        for name, _ in outputs:
            request.outputs.add().name = name
        try:
            response = await self.client._client_stub.ModelInfer(request=request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            mapping = {"TEXT": "input"} if param_map is None else param_map
            raise triton_error(exc, model_name, mapping) from None
        found = {out.name: (out, response.raw_output_contents[i]) for i, out in enumerate(response.outputs)}
        arrays = []
        for name, datatype in outputs:
            if name not in found:
                raise APIError(502, f"{model_name} answered without {name}", code="triton_error")
            out, raw = found[name]
            if out.datatype != datatype:
                raise APIError(502, f"{model_name} answered {name} as {out.datatype}, not {datatype}", code="triton_error")
            arrays.append(np.frombuffer(raw, dtype=_WIRE_DTYPES[datatype]).reshape(tuple(out.shape)))
        return arrays

    async def embed_texts(
        self,
        model: EmbeddingModel,
        blobs: list[bytes],
        request_id: str,
        priority_class: str | None = None,
        *,
        truncate: bool = False,
        truncation_direction: str = RIGHT,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The vectors of ``blobs`` (UTF-8 texts) from the priority class's text entry, and each
        text's token count as the model's tokenizer counted it (the whole text). A text over the
        model's limit is refused by the model (APIError 400 context_length_exceeded, its index in
        ``blobs`` in ``.data.values``) unless ``truncate``; then ``truncation_direction`` (checked
        by the caller: ``right`` or ``left``) says which end is kept."""
        return await self.embed_rows(model, blobs, request_id, priority_class, [(truncate, truncation_direction)] * len(blobs))

    async def embed_rows(
        self,
        model: EmbeddingModel,
        blobs: list[bytes],
        request_id: str,
        priority_class: str | None,
        options: list[tuple[bool, str]],
    ) -> tuple[np.ndarray, np.ndarray]:
        """embed_texts with each text's own (truncate, direction): what the Coalescer sends."""
        # BYTES tensors on the wire: each element a 4-byte little-endian length, then its bytes.
        raw = b"".join(_LENGTH.pack(len(b)) + b for b in blobs)
        tensors: list[tuple[str, str, tuple[int, ...], bytes]] = [("TEXT", "BYTES", (len(blobs), 1), raw)]
        if any(t or d != RIGHT for t, d in options):  # else the model's defaults: nothing more on the wire
            flags = np.array([t for t, _ in options], dtype=np.bool_).tobytes()
            tensors.append((TRUNCATE_INPUT, "BOOL", (len(blobs), 1), flags))
            ways = b"".join(_LENGTH.pack(len(d)) + d.encode() for _, d in options)
            tensors.append((DIRECTION_INPUT, "BYTES", (len(blobs), 1), ways))
        vectors, counts = await self._infer(
            model.entries(priority_class)[0], tensors, (("EMBEDDING", "FP32"), (TOKEN_COUNT_OUTPUT, "INT32")), request_id
        )
        return vectors, counts.reshape(-1)

    async def rerank_pairs(
        self, model: RerankerModel, query: bytes, documents: list[bytes], request_id: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """One call of a cross-encoder reranker: the raw logit of (query, documents[i]) and the
        tokens of each pair (at most ``model.max_documents`` documents, the caller splits). A pair
        the model refuses is an APIError whose ``data`` names ``DOCUMENTS[i]`` (or ``QUERY``)."""
        tensors: list[tuple[str, str, tuple[int, ...], bytes]] = [
            ("QUERY", "BYTES", (1,), _LENGTH.pack(len(query)) + query),
            ("DOCUMENTS", "BYTES", (len(documents),), b"".join(_LENGTH.pack(len(d)) + d for d in documents)),
        ]
        scores, counts = await self._infer(
            model.id, tensors, (("SCORES", "FP32"), (TOKEN_COUNT_OUTPUT, "INT32")), request_id, param_map={}
        )
        return scores.reshape(-1), counts.reshape(-1)

    def _coalescer(self, model: EmbeddingModel, priority_class: str | None) -> Coalescer:
        key = (model.id, priority_class)
        found = self._coalescers.get(key)
        if found is None:
            found = self._coalescers[key] = Coalescer(self, model, priority_class, self.coalesce_max_rows)
        return found

    async def embed(self, job: EmbeddingJob, request_id: str, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """The job's vectors in input order and each input's token count (the model's for
        texts, the array's length for token arrays); its chunks are sent one after the other."""
        model: EmbeddingModel = job.model
        spans = job.chunks()

        async def one(k: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
            rid = request_id if len(spans) == 1 else f"{request_id}.{k}"
            if job.texts is not None:
                assert job.blobs is not None  # check_request encodes the texts
                option = (job.truncate, job.truncation_direction)
                try:
                    if len(spans) == 1 and self.coalesce:
                        return await self._coalescer(model, job.priority_class).submit(job.blobs, rid, option)
                    return await self.embed_texts(
                        model, job.blobs[start:stop], rid, job.priority_class, truncate=option[0], truncation_direction=option[1]
                    )
                except APIError as exc:
                    # The model refused a text over its limit: named as the request's input, from the error's data.
                    data = exc.data
                    if data is None or data.code != CONTEXT_LENGTH or not isinstance(data.values.get("index"), int):
                        raise
                    raise context_length_error(start + data.values["index"], int(data.values.get("tokens", 0)), model) from None
            assert job.ids is not None  # one of texts and ids
            rows = job.ids[start:stop]
            ids, mask = pad_ids(rows, model.buckets, pad_id)
            (vectors,) = await self._infer(
                model.entries(job.priority_class)[1],
                [
                    ("input_ids", "INT64", ids.shape, ids.astype("<i8").tobytes()),
                    ("attention_mask", "INT64", mask.shape, mask.astype("<i8").tobytes()),
                ],
                ((model.ids_output, "FP32"),),
                rid,
            )
            # Each array's length as sent (before any truncation), as texts report theirs.
            counts = job.counts[start:stop] if job.counts is not None else [len(r) for r in rows]
            return vectors, np.array(counts, dtype=np.int32)

        if len(spans) == 1:
            return await one(0, *spans[0])
        # One batch at a time: sent together, a long list would be refused by its own priority
        # class's admission (a batch of max_batch_size fills the default class's rows in flight).
        parts = [await one(k, a, b) for k, (a, b) in enumerate(spans)]
        return np.concatenate([p[0] for p in parts], axis=0), np.concatenate([p[1] for p in parts])

    # --- generation ----------------------------------------------------------------------

    async def generate(self, job: GenerationJob, request_id: str) -> AsyncGenerator[Piece, None]:
        """The pieces of one generation; leaving the iteration early cancels the Triton request
        (the gRPC call is cancelled, the model sees it and frees the KV blocks).

        A stream that Triton loses after its first piece (503: its instance or replica died) is
        sent again with the token ids already sent as ``prefix_token_ids``, for up to
        RESUME_WAIT_S: the model continues the answer after them, and the client sees no error
        (docs/generation.md#streams-that-outlive-a-replica). Before the first piece the error
        goes to the client as before (a 503 it retries)."""
        import grpc
        from tritonclient.utils import InferenceServerException

        from clients.generation import GenerateRequest
        from clients.generation.grpc_transport import let_end

        continuable = job.model.continuable and job.n == 1 and not job.logprobs
        request = GenerateRequest(
            job.text_input, job.sampling, chat=job.chat, return_token_ids=continuable, prompt_token_ids=job.prompt_token_ids
        )
        param_map = job.fields
        sent: list[int] = []  # the token ids of the pieces given to the client
        pieces = 0
        lost_since: float | None = None
        while True:

            async def requests(request=request):
                yield {
                    "model_name": job.model.id,
                    "inputs": request.grpc_inputs(job.stream),
                    "request_id": request_id,
                    "parameters": {"triton_enable_empty_final_response": True},
                }

            call = self.client.stream_infer(requests(), stream_timeout=self.generation_timeout_s)
            finished = False
            try:
                async for result, error in self._watched(call, job.model.id):
                    if error is not None:
                        raise triton_error(error, job.model.id, param_map)
                    piece = Piece.of(result)
                    sent.extend(piece.token_ids)
                    pieces += 1
                    lost_since = None
                    if piece.final:
                        finished = True
                        let_end(call)
                        yield piece
                        return
                    yield piece
                finished = True
                return
            except grpc.RpcError as exc:
                finished = True
                failure = triton_error(exc, job.model.id, param_map)
            except InferenceServerException as exc:
                failure = triton_error(exc, job.model.id, param_map)
            except APIError as exc:
                failure = exc
            finally:
                if not finished:
                    call.cancel()
            now = time.monotonic()
            lost_since = now if lost_since is None else lost_since
            # 503, or what tritonserver says of a dead instance ("Stub process ... is not healthy",
            # no data) once the watchdog has the model marked (its next scan, within half a second)
            marked = self.health_dir / job.model.id if self.health_dir is not None else None
            lost = failure.status == 503 or (marked is not None and marked.exists())
            if not lost and marked is not None and continuable and pieces and failure.data is None:
                await asyncio.sleep(WATCHDOG_SCAN_S)
                lost = marked.exists()
            if not (continuable and pieces and lost and now - lost_since < RESUME_WAIT_S):
                raise failure from None
            log.info("generation %s: stream lost after %d token(s) (%s); continuing it", request_id, len(sent), failure.message)
            self.streams_resumed += 1
            await asyncio.sleep(RESUME_BACKOFF_S)
            request = replace(request, prefix_token_ids=tuple(sent))

    async def _watched(self, call, model: str):
        """The stream's items. With a watchdog folder, one task per stream looks at it every
        HEALTH_POLL_S: once ``model`` is marked there and no item came for that long, its instance
        died with this stream open (tritonserver 2.51 would keep it open and silent): the call is
        cancelled and the stream ends with 503."""
        items = call.__aiter__()
        if self.health_dir is None:
            async for item in items:
                yield item
            return
        marked = self.health_dir / model
        last = time.monotonic()
        lost = False

        async def watch() -> None:
            nonlocal lost
            while not (marked.exists() and time.monotonic() - last >= HEALTH_POLL_S):
                await asyncio.sleep(HEALTH_POLL_S)
            lost = True
            call.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            while True:
                try:
                    item = await items.__anext__()
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not lost:
                        raise
                    raise APIError(
                        503,
                        f"model {model} lost the instance serving this stream (its python backend "
                        f"stub died; it is being reloaded): retry",
                        code="model_unavailable",
                        type="server_error",
                        headers={"Retry-After": "1"},
                    ) from None
                last = time.monotonic()
                yield item
        finally:
            watcher.cancel()


HEALTH_POLL_S = 0.25
# A generation stream lost after its first piece: how long it is sent again, the pause before each send.
RESUME_WAIT_S = 30.0
RESUME_BACKOFF_S = 0.25
WATCHDOG_SCAN_S = 0.5  # the stub watchdog's scan interval, twice (server/stubs.py)


class Coalescer:
    """Concurrent embeddings requests of one model sent to Triton as one request.

    A request joins the batch that is being gathered in the current turn of the event loop;
    the batch leaves at the end of that turn (``call_soon``), so nothing waits for a timer.
    Under load several requests arrive per turn and one gRPC call, one Triton request and
    one cache lookup serve them all, which is most of the gateway's cost per request. The
    Triton request's id is its requests' ids joined by commas. If a batch of several fails,
    each request is sent again alone, so one request's error is its own.
    """

    def __init__(
        self, backend: TritonBackend, model: EmbeddingModel, priority_class: str | None = None, max_rows: int | None = None
    ):
        self.backend = backend
        self.model = model
        self.priority_class = priority_class
        self.limit = max(1, min(model.max_batch_size, max_rows or model.max_batch_size))
        self.pending: list[tuple[list[bytes], str, asyncio.Future, tuple[bool, str]]] = []
        self.scheduled = False

    def submit(self, blobs: list[bytes], request_id: str, truncation: tuple[bool, str] = (False, RIGHT)) -> asyncio.Future:
        """Join the batch being gathered; the future gets this request's (vectors, token counts).
        ``truncation``: this request's (truncate, direction), sent per text, so requests that
        chose differently still share one Triton request."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((blobs, request_id, future, truncation))
        if not self.scheduled:
            self.scheduled = True
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self.scheduled = False
        pending, self.pending = self.pending, []
        group: list = []
        size = 0
        for item in pending:
            if item[2].done():  # its client went away before the batch left
                continue
            if group and size + len(item[0]) > self.limit:
                asyncio.ensure_future(self._send(group))
                group, size = [], 0
            group.append(item)
            size += len(item[0])
        if group:
            asyncio.ensure_future(self._send(group))

    async def _send(self, group: list) -> None:
        self.backend.on_batch(len(group))
        if len(group) == 1:
            await self._alone(group[0])
            return
        blobs = [b for item in group for b in item[0]]
        options = [item[3] for item in group for _ in item[0]]
        try:
            vectors, counts = await self.backend.embed_rows(
                self.model, blobs, ",".join(item[1] for item in group), self.priority_class, options
            )
        except APIError as exc:
            if exc.status == 503:  # the class is at capacity: sending each again would add load
                for _, _, future, _ in group:
                    if not future.done():
                        future.set_exception(exc)
                return
            await asyncio.gather(*(self._alone(item) for item in group))
            return
        except BaseException as exc:
            for _, _, future, _ in group:
                if not future.done():
                    future.set_exception(exc)
            return
        start = 0
        for item_blobs, _, future, _ in group:
            stop = start + len(item_blobs)
            if not future.done():
                future.set_result((vectors[start:stop], counts[start:stop]))
            start = stop

    async def _alone(self, item) -> None:
        blobs, request_id, future, option = item
        try:
            rows = await self.backend.embed_rows(self.model, blobs, request_id, self.priority_class, [option] * len(blobs))
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(rows)
