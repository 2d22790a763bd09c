"""``/tokenize`` and ``/detokenize``: a served model's own tokenizer (and chat template), in vLLM's shapes."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request, Security

from openai_gateway import tokenize
from openai_gateway.errors import model_not_found
from openai_gateway.responses import json_response
from openai_gateway.routes import bearer
from openai_gateway.schemas import DetokenizeRequest, TokenizeRequest
from openai_gateway.state import GatewayState, gateway_state, request_info

router = APIRouter()


def _tokenizer(st: GatewayState, name: str) -> tokenize.ModelTokenizer:
    """The tokenizer of the model ``name`` (id or alias, either kind); 404 listing those served."""
    model = st.catalog.find(name, "embedding") or st.catalog.find(name, "generation")
    if model is None or model.id not in st.tokenizers:
        raise model_not_found(name, "embedding or generation", sorted(st.tokenizers))
    return st.tokenizers[model.id]


@router.post("/tokenize", dependencies=[Security(bearer)])
async def tokenize_text(body: TokenizeRequest, request: Request):
    """A prompt's (or a chat's, rendered with the model's template) token ids, count and the model's context."""
    st = gateway_state(request)
    request_info(request)["model"] = body.model
    tok = _tokenizer(st, body.model)
    answer = tokenize.tokenize_body(tok, body, st.settings.max_prompt_chars, st.settings.max_messages)
    return json_response(200, orjson.dumps(answer))


@router.post("/detokenize", dependencies=[Security(bearer)])
async def detokenize_ids(body: DetokenizeRequest, request: Request):
    """The text of token ids of the model's vocabulary (special tokens written out)."""
    st = gateway_state(request)
    request_info(request)["model"] = body.model
    return json_response(200, orjson.dumps(tokenize.detokenize_body(_tokenizer(st, body.model), body)))
