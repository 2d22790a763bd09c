"""``/v1/models`` and ``/v1/models/{model}``: the models served now, as OpenAI lists them."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request, Security

from openai_gateway.catalog import OWNER, GenerationModel, Model
from openai_gateway.errors import APIError
from openai_gateway.responses import json_response
from openai_gateway.routes import bearer
from openai_gateway.state import gateway_state

router = APIRouter()


def model_object(m: Model) -> dict:
    """OpenAI's model object (``created``: when its files were exported; ``owned_by``: the
    organisation of its Hugging Face name), with vLLM's ``max_model_len`` (the tokens one request
    may hold: prompt and answer for generation, one input for embeddings and reranking) and this
    gateway's ``aliases`` and ``kind``."""
    owner = next((a.split("/", 1)[0] for a in m.aliases if "/" in a), OWNER)
    context = m.max_model_len if isinstance(m, GenerationModel) else m.max_tokens
    return {
        "id": m.id,
        "object": "model",
        "created": m.created,
        "owned_by": owner,
        "max_model_len": context,
        "aliases": list(m.aliases),
        "kind": m.kind,
    }


@router.get("/v1/models", dependencies=[Security(bearer)])
async def list_models(request: Request):
    """The models ready in Triton that the gateway serves; 503 while Triton is not ready."""
    st = gateway_state(request)
    if not st.backend.server_ready:
        raise APIError(503, "Triton is not ready yet", code="triton_unavailable", headers={"Retry-After": "1"})
    return json_response(200, orjson.dumps({"object": "list", "data": [model_object(m) for m in st.servable()]}))


@router.get("/v1/models/{model:path}", dependencies=[Security(bearer)])
async def get_model(model: str, request: Request):
    """One served model, by id or alias; 404 when it is not served."""
    st = gateway_state(request)
    if not st.backend.server_ready:  # as /v1/models: not "does not exist" while Triton is down
        raise APIError(503, "Triton is not ready yet", code="triton_unavailable", headers={"Retry-After": "1"})
    found = next((m for m in st.servable() if model == m.id or model in m.aliases), None)
    if found is None:
        raise APIError(404, f"The model {model!r} does not exist or is not served", param="model", code="model_not_found")
    return json_response(200, orjson.dumps(model_object(found)))
