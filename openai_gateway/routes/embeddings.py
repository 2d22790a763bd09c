"""``/v1/embeddings``: texts (or token ids) to vectors, through the priority class's entry model."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from openai_gateway import embeddings
from openai_gateway.catalog import EmbeddingModel
from openai_gateway.errors import APIError
from openai_gateway.responses import JSON, json_response
from openai_gateway.schemas import EmbeddingRequest
from openai_gateway.state import gateway_state, request_info
from openai_gateway.streaming import until_done_or_gone

# Picks the priority class's entry models for /v1/embeddings (docs/priority-classes.md).
PRIORITY_HEADER = "X-Priority-Class"

router = APIRouter()


def priority_header(request: Request) -> str | None:
    """The request's X-Priority-Class (docs/priority-classes.md), trimmed and lower-cased; None when absent."""
    value = request.headers.get(PRIORITY_HEADER)
    return None if value is None else value.strip().lower()


def priority_class_of(request: Request, model: EmbeddingModel) -> str | None:
    """The request's X-Priority-Class (docs/priority-classes.md), None when absent; 400 for a
    class the model has no entry for."""
    value = priority_header(request)
    if value is None:
        return None
    served = [cls for cls, _, _ in model.lanes] or ["default"]
    if value not in served:
        raise APIError(
            400,
            f"{PRIORITY_HEADER} must be one of {', '.join(served)} for {model.id}, got {value[:40]!r}",
            param=PRIORITY_HEADER,
            code="invalid_priority_class",
        )
    return None if value == "default" else value


# The hot route parses and validates its body itself, in one pass (pydantic-core reads the
# JSON bytes), instead of through FastAPI's body machinery; the schema is still published.
_BODY = {
    "requestBody": {"required": True, "content": {JSON: {"schema": EmbeddingRequest.model_json_schema()}}},
    "security": [{"HTTPBearer": []}],
}


@router.post("/v1/embeddings", openapi_extra=_BODY)
async def create_embeddings(request: Request):
    """Embed `input` with `model`: OpenAI's list of embedding objects and the prompt's token usage."""
    try:
        body = EmbeddingRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    st = gateway_state(request)
    backend, metrics = st.backend, st.metrics
    info = request_info(request)
    model: EmbeddingModel = st.find(body.model, "embedding")
    info["model"] = model.id
    vocabulary = st.vocabularies[model.id]
    if isinstance(body.input, list) and len(body.input) > 64:
        job = await asyncio.to_thread(embeddings.check_request, body, model, vocabulary, st.settings)
    else:
        job = embeddings.check_request(body, model, vocabulary, st.settings)
    info["texts"] = job.size
    job.priority_class = priority_class_of(request, model)
    backend.require_ready(model)
    if job.priority_class is not None:
        backend.require_entry_ready(model, job.priority_class)
    work = backend.embed(job, info["request_id"], vocabulary.pad_id)
    # One batch is over in milliseconds: watching for a disconnect would cost more than it saves.
    vectors, counts = await (work if len(job.chunks()) == 1 else until_done_or_gone(request, work, metrics, "/v1/embeddings"))
    # The model counted each text's tokens (the whole text) and refused one over the context
    # length unless the request said truncate (docs/embeddings.md#truncation).
    prompt_tokens = int(counts.sum())
    info["prompt_tokens"] = prompt_tokens
    metrics.count_tokens(info["key_id"], model.id, prompt_tokens)
    return json_response(200, embeddings.response_body(job, vectors, prompt_tokens))
