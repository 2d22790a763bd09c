"""Request bodies as OpenAI defines them, for validation and the OpenAPI schema (``/openapi.json``).

Types are strict (no ``"1"`` for 1, no ``true`` for 1). Unknown fields are ignored, as
OpenAI-compatible servers do, so newer SDKs keep working; fields of OpenAI's and vLLM's APIs that
ask for what this server does not serve (``functions``, ``use_beam_search``, ...) are refused with
400 by the request checks (openai_gateway/request_fields.py), not ignored.
Limits with messages that name them are checked in ``embeddings.py`` and ``completions.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, create_model

from contract.sampling import SAMPLING_FIELDS

Number = Union[StrictInt, StrictFloat]  # noqa: UP007 (pydantic's Strict types are Annotated aliases)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EmbeddingRequest(_Body):
    """The body of `POST /v1/embeddings`."""

    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="A text, a list of texts, a list of token ids, or a list of token id lists "
        "(ids of the model's own tokenizer, special tokens included)"
    )
    model: StrictStr
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    # TEI's names (the openai SDK sends them in extra_body); docs/embeddings.md#truncation.
    truncate: StrictBool = Field(
        False, description="false (default): an input over the model's context length is refused (400 context_length_exceeded)"
    )
    truncation_direction: StrictStr = Field(
        "right", description="with truncate: right (default) keeps an input's first tokens, left its last ones"
    )


class TextPart(_Body):
    """A part of a chat message's content (only text parts are served)."""

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Body):
    """One message of a chat."""

    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls (openai_gateway/tools.py)
    tool_call_id: StrictStr | None = None  # a tool message's call


class TokenizeRequest(_Body):
    """The body of `POST /tokenize` (vLLM's): a prompt, or chat messages rendered with the model's template."""

    model: StrictStr
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = Field(None, description="default: true for a prompt, false for messages")
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    """The body of `POST /detokenize` (vLLM's)."""

    model: StrictStr
    tokens: list[StrictInt]


class StreamOptions(_Body):
    """`stream_options`: `include_usage` adds a last chunk with the usage; vLLM's
    `continuous_usage_stats` puts the usage so far on every chunk too."""

    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


# JSON types of the sampling fields' table (contract/sampling.py) as strict types.
_TYPES: dict[tuple[type, ...], Any] = {
    (int,): StrictInt,
    (int, float): Number,
    (bool,): StrictBool,
    (str, list): StrictStr | list[StrictStr],
    (dict,): dict[StrictStr, Number],
    (dict, str): dict[StrictStr, Any] | StrictStr,
    (str,): StrictStr,
    (list,): list[StrictStr],
}


class _OpenAISampling(_Body):
    # Undeclared fields are kept (``model_extra``) for openai_gateway/request_fields.py to judge.
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None


# The engine's sampling fields, from its one table: OpenAI's own (max_tokens, temperature, top_p,
# seed, stop) and vLLM's extensions (the openai SDK's extra_body), which go to the engine as they are.
_SHAPES = {"structured_outputs": dict[StrictStr, Any]}  # an object of guides: the engine judges its keys
# vLLM's prompt_logprobs answers in a shape of its own; here the prompt's log-probabilities come with
# /v1/completions' echo (openai_gateway/completions.py), and the field is refused by name (request_fields.py).
_ENGINE_ONLY = ("prompt_logprobs",)
_FIELDS: dict[str, Any] = {
    f.name: (
        _SHAPES.get(f.name, list[StrictInt] if f.kinds == (list,) and f.items is int else _TYPES[f.kinds]) | None,
        Field(None, description=f.doc),
    )
    for f in SAMPLING_FIELDS
    if f.name not in _ENGINE_ONLY
}
if TYPE_CHECKING:  # a class built at run time is Any to the checker
    _Sampling = Any
else:
    _Sampling = create_model("_Sampling", __base__=_OpenAISampling, **_FIELDS)


class ChatCompletionRequest(_Sampling):
    """The body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Any | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    """The body of `POST /v1/completions`."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    response_format: dict[str, Any] | None = None  # vLLM's extension: chat's structured output
