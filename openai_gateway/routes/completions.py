"""``/v1/chat/completions`` and ``/v1/completions`` on the generation model, whole or streamed."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Security

from openai_gateway import completions
from openai_gateway.catalog import GenerationModel
from openai_gateway.responses import json_response
from openai_gateway.routes import bearer
from openai_gateway.schemas import ChatCompletionRequest, CompletionRequest
from openai_gateway.state import gateway_state, request_info
from openai_gateway.streaming import EventStream, record_usage, sse_events, until_done_or_gone

router = APIRouter()


async def serve_generation(request: Request, job: completions.GenerationJob, route: str):
    """Run a checked generation job on Triton: the whole answer as one JSON body, or an SSE
    stream. The status waits for the first piece, so errors the engine finds at admission
    (context too long, queue full) get their own status instead of a 200 that fails."""
    st = gateway_state(request)
    backend, metrics = st.backend, st.metrics
    info = request_info(request)
    info["model"] = job.model.id
    backend.require_ready(job.model)
    started = time.perf_counter()
    pieces = backend.generate(job, info["request_id"])
    first = await until_done_or_gone(request, anext(pieces, None), metrics, route)
    if first is not None and (first.text or first.final):
        metrics.ttft.labels(job.model.id).observe(time.perf_counter() - started)
    if not job.stream:

        async def whole():
            texts: dict[int, list[str]] = {}
            tallies = completions.Tallies()
            piece = first
            while piece is not None:  # an empty final response may follow the answer
                texts.setdefault(piece.index, []).append(piece.text)
                tallies.add(piece)
                piece = None if piece.final else await anext(pieces, None)
            return {i: "".join(parts) for i, parts in texts.items()}, tallies

        texts, tallies = await until_done_or_gone(request, whole(), metrics, route)
        record_usage(info, job, tallies, metrics)
        return json_response(200, completions.whole_body(job, texts, tallies))
    return EventStream(
        sse_events(request, job, first, pieces, info, metrics),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.post("/v1/chat/completions", dependencies=[Security(bearer)])
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """Answer a chat with the model's chat template applied (OpenAI's chat completion or its chunks)."""
    st = gateway_state(request)
    model: GenerationModel = st.find(body.model, "generation")
    return await serve_generation(request, completions.check_chat(body, model, st.settings), "/v1/chat/completions")


@router.post("/v1/completions", dependencies=[Security(bearer)])
async def text_completions(body: CompletionRequest, request: Request):
    """Continue a prompt as it is (OpenAI's text completion or its chunks)."""
    st = gateway_state(request)
    model: GenerationModel = st.find(body.model, "generation")
    return await serve_generation(request, completions.check_completion(body, model, st.settings), "/v1/completions")
