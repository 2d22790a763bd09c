"""gRPC: one decoupled stream per request, the last response flagged ``triton_final_response``
(a whole answer is a stream of one request with ``stream`` false).

Each function is one attempt on one endpoint and returns ``(pieces, cancel)``: the Piece
iterator and a call that cancels the request on the server. The clients add the retries.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from tritonclient.utils import InferenceServerException

from clients.errors import with_rpc_data
from clients.generation.request import GenerateRequest, GenerationOptions, new_request_id
from clients.generation.response import Piece, is_final, piece_from_result, transport_error
from clients.transport import triton_client

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0  # at most this long to stop a cancelled gRPC stream
STREAM_END_S = 5.0  # a finished stream's wait for tritonserver's end of it (let_end)
_ENDING: set[asyncio.Task] = set()  # finished streams being read to their end


def let_end(call: Any) -> None:
    """After a stream's final response, read it to its end in the background (tritonclient.grpc.aio's
    stream iterator), so that it ends with tritonserver's OK instead of the cancellation a dropped call
    gets: tritonserver 2.51 keeps waiting for a cancellation that arrives after the final response
    ("Waiting for the callback to retrieve cancellation") and, with it, the model, which then never
    unloads at shutdown (the exit timeout runs out). Cancelled after STREAM_END_S if it does not end."""

    async def read_to_end() -> None:
        try:
            async with asyncio.timeout(STREAM_END_S):
                async for _ in call:
                    pass
        except Exception:  # timed out or failed after its final response: nothing to answer
            call.cancel()

    task = asyncio.ensure_future(read_to_end())
    _ENDING.add(task)
    task.add_done_callback(_ENDING.discard)


def grpc_stream(
    connections: dict[str, Any],
    o: GenerationOptions,
    request: GenerateRequest,
    stream: bool,
    url: str | None = None,
    first_timeout_s: float | None = None,
):
    """Blocking: the request on ``url``'s tritonclient stream (kept in ``connections``, which
    loses a client whose cancelled stream would not stop); responses reach a queue from
    tritonclient's thread."""
    url = url or o.url
    if url not in connections:
        connections[url] = triton_client("grpc", url)
    client = connections[url]
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    state = {"open": True}

    def stop(cancel: bool) -> None:
        if state["open"]:
            state["open"] = False
            if not cancel:
                client.stop_stream(cancel_requests=False)
                return
            # Cancelling (Ctrl-C, close() mid-stream) must not hang the caller: tritonclient's
            # stop_stream joins its stream thread, which can wait on a call gRPC is still
            # tearing down. Bounded here; a client whose stream did not stop is replaced.
            stopper = threading.Thread(
                target=client.stop_stream, kwargs={"cancel_requests": True}, name="generation-stream-stop", daemon=True
            )
            stopper.start()
            stopper.join(STOP_TIMEOUT_S)
            if stopper.is_alive():
                log.warning(
                    "generate: the cancelled gRPC stream did not stop within %.0f s; using a new connection", STOP_TIMEOUT_S
                )
                if connections.get(url) is client:
                    del connections[url]

    def pieces() -> Iterator[Piece]:
        request_id = new_request_id()
        log.debug("generate: %s %s via grpc %s", o.model, request_id, url)
        wait = first_timeout_s if first_timeout_s is not None else o.timeout_s
        try:
            try:
                client.async_stream_infer(
                    o.model,
                    request.grpc_inputs(stream),
                    model_version=o.model_version,
                    request_id=request_id,
                    enable_empty_final_response=True,
                )
            except InferenceServerException:
                # A stream that failed at once (server unreachable) refuses the request; the
                # reason is the error its callback received, if it came.
                try:
                    _, error = responses.get(timeout=1.0)
                except queue.Empty:
                    raise
                if error is None:
                    raise
                raise error from None
            while True:
                try:
                    result, error = responses.get(timeout=wait)
                except queue.Empty:
                    raise TimeoutError from None
                wait = o.timeout_s
                if error is not None:
                    raise error
                yield piece_from_result(result)
                if is_final(result):
                    stop(cancel=False)
                    return
        except (InferenceServerException, OSError, TimeoutError) as exc:
            stop(cancel=True)
            raise transport_error(exc, "grpc", url, o.model, o.timeout_s) from exc

    return pieces(), lambda: stop(cancel=True)


def grpc_aio_stream(
    o: GenerationOptions,
    client: Any,
    request: GenerateRequest,
    stream: bool,
    url: str | None = None,
    first_timeout_s: float | None = None,
):
    """asyncio: the request as its own ``stream_infer`` call on ``client`` (grpc.aio), so many
    run at once on one channel."""
    import grpc
    from tritonclient.grpc._utils import get_error_grpc

    url = url or o.url
    call: dict[str, Any] = {}

    async def requests():
        yield {
            "model_name": o.model,
            "inputs": request.grpc_inputs(stream),
            "model_version": o.model_version,
            "request_id": new_request_id(),
            "parameters": {"triton_enable_empty_final_response": True},
        }

    async def pieces() -> AsyncIterator[Piece]:
        log.debug("generate: %s via grpc.aio %s", o.model, url)
        iterator = client.stream_infer(requests())
        call["it"] = iterator
        wait = first_timeout_s if first_timeout_s is not None else o.timeout_s
        try:
            while True:
                try:
                    result, error = await asyncio.wait_for(iterator.__anext__(), wait)
                except StopAsyncIteration:
                    return
                wait = o.timeout_s
                if error is not None:
                    raise error
                if is_final(result):
                    let_end(iterator)
                    yield piece_from_result(result)
                    return
                yield piece_from_result(result)
        except grpc.RpcError as exc:  # the call itself failed (server down, cancelled, the door's refusal)
            raise transport_error(with_rpc_data(get_error_grpc(exc), exc), "grpc", url, o.model, o.timeout_s) from exc
        except (TimeoutError, InferenceServerException, OSError) as exc:
            iterator.cancel()
            raise transport_error(exc, "grpc", url, o.model, o.timeout_s) from exc

    async def cancel() -> None:
        if "it" in call:
            call["it"].cancel()

    return pieces(), cancel
