"""Answers that outlive one await: work cancelled when its client goes away, and the SSE loop
of a streamed completion."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import StreamingResponse

from openai_gateway import completions
from openai_gateway.errors import APIError
from openai_gateway.gate import route_label
from openai_gateway.metrics import GatewayMetrics


class EventStream(StreamingResponse):
    """SSE that closes its iterator however the response ends (a client gone mid-stream
    included), so the generation's Triton request is cancelled at once, not at garbage collection."""

    body_iterator: AsyncGenerator[bytes, None]

    async def stream_response(self, send) -> None:
        """Send the stream, then close its iterator whatever happened."""
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


class ClientGone(Exception):
    """The client disconnected before its answer; its Triton work was cancelled."""


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


def record_usage(info: dict, job: completions.GenerationJob, tally: completions.Tallies, metrics: GatewayMetrics) -> None:
    """A generation's token counts into its log line and the per-key token metrics."""
    info["prompt_tokens"], info["completion_tokens"] = tally.prompt_tokens, tally.completion_tokens
    metrics.count_tokens(info["key_id"], job.model.id, tally.prompt_tokens, tally.completion_tokens)


async def sse_events(
    request: Request, job: completions.GenerationJob, first, pieces: AsyncGenerator, info: dict, metrics: GatewayMetrics
) -> AsyncGenerator[bytes, None]:
    """The SSE chunks of a streamed completion, from its ``first`` piece on: the text pieces, then
    the finish (and usage) chunk and ``[DONE]``; an error mid-stream as an error event. However
    it ends, the Triton stream is closed and the usage counted."""
    writer = completions.ChunkWriter(job)
    tally = completions.Tallies()
    completed = False
    try:
        head = writer.start(first)
        if head:
            yield head
        piece = first
        while piece is not None:
            choice = tally.add(piece)
            if piece.text or piece.logprobs:
                yield writer.text(piece.text, piece.logprobs, piece.index, tally.usage if job.continuous_usage else None)
            if piece.finish_reason is not None and job.n > 1:  # that choice ended; the others go on
                yield writer.finish_choice(piece.index, choice)
            if piece.final:
                break
            piece = await anext(pieces, None)
        completed = True
        yield writer.finish(tally)
    except APIError as exc:
        info["error"] = exc.type
        yield writer.error(exc.body())
    finally:
        if not completed and "error" not in info:
            info["error"] = "client_disconnected"
            metrics.cancelled.labels(route_label(request.url.path)).inc()
        await pieces.aclose()
        record_usage(info, job, tally, metrics)
