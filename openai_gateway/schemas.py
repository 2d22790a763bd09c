"""Request bodies as OpenAI defines them, for validation and the OpenAPI schema (``/openapi.json``).

Types are strict (no ``"1"`` for 1, no ``true`` for 1). Unknown fields are ignored, as
OpenAI-compatible servers do, so newer SDKs keep working; fields this server cannot honour
(``logprobs``, tools, penalties) are refused with 400 by the request checks, not ignored.
Limits with messages that name them are checked in ``embeddings.py`` and ``completions.py``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EmbeddingRequest(_Body):
    """The body of `POST /v1/embeddings`."""

    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]] = Field(
        description="A text, a list of texts, a list of token ids, or a list of token id lists "
        "(ids of the model's own tokenizer, special tokens included)")
    model: StrictStr
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[StrictInt] = None
    user: Optional[StrictStr] = None


class TextPart(_Body):
    """A part of a chat message's content (only text parts are served)."""

    type: StrictStr
    text: Optional[StrictStr] = None


class ChatMessage(_Body):
    """One message of a chat."""

    role: StrictStr
    content: Union[StrictStr, list[TextPart], None] = None
    name: Optional[StrictStr] = None


class StreamOptions(_Body):
    """`stream_options`: `include_usage` adds a last chunk with the usage."""

    include_usage: Optional[StrictBool] = None


class _Sampling(_Body):
    model: StrictStr
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    n: Optional[StrictInt] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    logit_bias: Optional[dict[str, Any]] = None
    user: Optional[StrictStr] = None
    # vLLM's extensions (the openai SDK's extra_body), passed to the engine as they are.
    top_k: Optional[StrictInt] = None
    min_tokens: Optional[StrictInt] = None
    repetition_penalty: Optional[Number] = None
    ignore_eos: Optional[StrictBool] = None


class ChatCompletionRequest(_Sampling):
    """The body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None


class CompletionRequest(_Sampling):
    """The body of `POST /v1/completions`."""

    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    echo: Optional[StrictBool] = False
    suffix: Optional[StrictStr] = None
    logprobs: Optional[StrictInt] = None
    best_of: Optional[StrictInt] = None
