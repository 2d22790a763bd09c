"""``/v1/chat/completions`` and ``/v1/completions`` on the generation model, whole or streamed."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from fastapi import APIRouter, Request, Security

from openai_gateway import completions
from openai_gateway.catalog import GenerationModel
from openai_gateway.responses import json_response
from openai_gateway.routes import bearer
from openai_gateway.routes.embeddings import PRIORITY_HEADER, priority_header
from openai_gateway.schemas import ChatCompletionRequest, CompletionRequest
from openai_gateway.state import gateway_state, request_info
from openai_gateway.streaming import EventStream, record_usage, sse_events, until_done_or_gone

router = APIRouter()


def with_priority_class(request: Request, job: completions.GenerationJob) -> completions.GenerationJob:
    """The X-Priority-Class header as the engine's ``priority_class`` field (over the body's), for
    ``job`` and its siblings; the engine checks the value, and its error names the header."""
    value = priority_header(request)
    if value is not None:
        for part in (job, *job.siblings):
            part.sampling["priority_class"] = value
            part.fields["priority_class"] = PRIORITY_HEADER
    return job


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


async def serve_prompts(request: Request, job: completions.GenerationJob, route: str):
    """A list of prompts (the job and its siblings): one Triton request each, run at once, their
    choices in one answer numbered as OpenAI numbers them; the first error fails the request."""
    st = gateway_state(request)
    backend, metrics = st.backend, st.metrics
    info = request_info(request)
    info["model"] = job.model.id
    backend.require_ready(job.model)
    jobs = [job, *job.siblings]

    async def one(k: int, part: completions.GenerationJob) -> tuple[dict[int, str], completions.Tallies]:
        texts: dict[int, str] = {}
        tallies = completions.Tallies()
        pieces = backend.generate(part, f"{info['request_id']}-{k}")
        try:
            async for piece in pieces:
                piece = replace(piece, index=piece.index + part.first_index)
                texts[piece.index] = texts.get(piece.index, "") + piece.text
                tallies.add(piece)
                if piece.final:
                    break
        finally:
            await pieces.aclose()
        return texts, tallies

    async def every() -> list[tuple[dict[int, str], completions.Tallies]]:
        tasks = [asyncio.ensure_future(one(k, part)) for k, part in enumerate(jobs)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    results = await until_done_or_gone(request, every(), metrics, route)
    texts = {i: text for part, _ in results for i, text in part.items()}
    tallies = [t for _, t in results]
    # the usage for the log line and the metrics: every prompt's
    info["prompt_tokens"] = sum(t.prompt_tokens for t in tallies)
    info["completion_tokens"] = sum(t.completion_tokens for t in tallies)
    metrics.count_tokens(info["key_id"], job.model.id, info["prompt_tokens"], info["completion_tokens"])
    return json_response(200, completions.whole_body(job, texts, tallies))


@router.post("/v1/chat/completions", dependencies=[Security(bearer)])
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """Answer a chat with the model's chat template applied (OpenAI's chat completion or its chunks)."""
    st = gateway_state(request)
    model: GenerationModel = st.find(body.model, "generation")
    job = with_priority_class(request, completions.check_chat(body, model, st.settings))
    return await serve_generation(request, job, "/v1/chat/completions")


@router.post("/v1/completions", dependencies=[Security(bearer)])
async def text_completions(body: CompletionRequest, request: Request):
    """Continue a prompt as it is (OpenAI's text completion or its chunks)."""
    st = gateway_state(request)
    model: GenerationModel = st.find(body.model, "generation")
    job = with_priority_class(request, completions.check_completion(body, model, st.settings, st.tokenizers.get(model.id)))
    if job.siblings:
        return await serve_prompts(request, job, "/v1/completions")
    return await serve_generation(request, job, "/v1/completions")
