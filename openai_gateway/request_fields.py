"""What the gateway does with each request field of OpenAI's and vLLM's chat and completion APIs
that its schemas (openai_gateway/schemas.py) do not serve: no request fails open.

``UNSERVED``: fields that name a sampling, constraint, prompt or output behaviour this server
knows but does not serve. A request that sends one with a value other than its no-op default
is refused with 400 naming the field, never answered as if the field had not been sent.
``IGNORED``: fields that change nothing an answer holds here (hints, bookkeeping, another
deployment's plumbing), accepted and dropped. Any other unknown field is ignored too, as
OpenAI-compatible servers do, so newer SDKs keep working (docs/openai-gateway.md#request-fields).
"""

from __future__ import annotations

from typing import Any

from openai_gateway.errors import bad_request

_NONE: tuple[Any, ...] = (None,)
_EMPTY: tuple[Any, ...] = (None, [], {})

# field -> (values that ask for nothing, why any other value is refused)
UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    # vLLM's sampling parameters
    "use_beam_search": ((None, False), "beam search is not served"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search, which is not served"),
    "prompt_logprobs": (_NONE, "prompt log-probabilities are not served"),
    "logprob_token_ids": (_NONE, "log-probabilities of chosen token ids are not served; use top_logprobs"),
    "allowed_token_ids": (_NONE, "allowed_token_ids is not served; use logit_bias or a guide (structured_outputs)"),
    "bad_words": (_EMPTY, "bad_words is not served; use logit_bias"),
    "truncate_prompt_tokens": (_NONE, "prompt truncation is not served on generation: a prompt over the context is refused"),
    "truncation_side": (_NONE, "prompt truncation is not served on generation"),
    "spaces_between_special_tokens": ((None, True), "special tokens are decoded as the tokenizer joins them"),
    "watermarking": ((None, False), "watermarking is not served"),
    "thinking_token_budget": (_NONE, "this model does not reason: no thinking budget applies"),
    "repetition_detection": (_NONE, "repetition detection is not served; use repetition_penalty or frequency_penalty"),
    "logits_processors": (_EMPTY, "custom logits processors are not served"),
    # vLLM's prompt and template parameters
    "add_generation_prompt": ((None, True), "the chat template always ends with the assistant's turn here"),
    "continue_final_message": ((None, False), "continuing the final message is not served"),
    "add_special_tokens": ((None, False), "the chat template adds the special tokens; extra ones are not served"),
    "documents": (_EMPTY, "documents for the chat template are not served"),
    "chat_template": (_NONE, "a request's own chat template is not served: the model's template renders every chat"),
    "chat_template_kwargs": (_EMPTY, "chat_template_kwargs are not served"),
    "media_io_kwargs": (_EMPTY, "only text is served"),
    "mm_processor_kwargs": (_EMPTY, "only text is served"),
    "priority": ((None, 0), "send the X-Priority-Class header instead (docs/priority-classes.md)"),
    "cache_salt": (_NONE, "a salted prefix cache is not served"),
    "kv_transfer_params": (_EMPTY, "disaggregated serving is not served"),
    "ec_transfer_params": (_EMPTY, "disaggregated serving is not served"),
    "vllm_xargs": (_EMPTY, "vLLM's extension arguments are not served"),
    # vLLM's output parameters
    "return_tokens_as_token_ids": ((None, False), "tokens as token ids are not served"),
    "return_token_ids": (
        (None, False),
        "token ids in the answer are not served here (the KServe generate endpoint returns them)",
    ),
    "return_prompt_text": ((None, False), "the rendered prompt is not returned; POST /tokenize renders it"),
    # OpenAI's
    "audio": (_NONE, "only text is served"),
    "modalities": ((None, ["text"]), "only text is served"),
    "reasoning_effort": (_NONE, "this model does not reason: reasoning_effort is not served"),
    "verbosity": (_NONE, "verbosity is not served"),
    "web_search_options": (_NONE, "web search is not served"),
    "store": ((None, False), "stored completions are not served"),
    "moderation": (_NONE, "moderation is not served"),
}

# Accepted and dropped: they change nothing an answer holds here.
IGNORED: dict[str, str] = {
    "safety_identifier": "an end-user id for the caller's own records",
    "metadata": "tags for stored completions, which are not served (store is refused)",
    "service_tier": "one tier; priority classes come from the X-Priority-Class header",
    "prediction": "a latency hint for predicted outputs; the answer is the same without it",
    "prompt_cache_key": "prefix caching is automatic for every request",
    "prompt_cache_options": "prefix caching is automatic for every request",
    "prompt_cache_retention": "prefix caching is automatic for every request",
    "request_id": "the gateway names each request itself",
    "session_id": "no session state is kept",
    "include_reasoning": "this model does not reason: there is no reasoning to include or leave out",
    "stream_interval": "every token is sent as it comes",
    "return_token_offsets": "offsets are returned by vLLM's render endpoints only",
    "return_mm_kwargs": "only text is served: there are no multimodal features to return",
    "routed_experts_prompt_start": "this model is not a mixture of experts",
    "guided_decoding_backend": "one guide backend (llguidance) serves every guide",
    "guided_whitespace_pattern": "guides emit compact JSON",
}


def refuse_unserved(extra: dict[str, Any] | None, chat: bool) -> None:
    """400 naming the first field in ``extra`` (the request's fields the schema does not declare)
    that asks for a behaviour this server does not serve."""
    if chat and (extra or {}).get("echo") not in (None, False):  # vLLM's chat echo; /v1/completions serves its own
        raise bad_request("echo: repeating the last message is not served on chat completions", param="echo")
    refuse_listed(extra, UNSERVED)


def refuse_listed(extra: dict[str, Any] | None, rules: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """400 (``unsupported_parameter``) naming the first field in ``extra`` that ``rules`` (field ->
    (values that ask for nothing, why any other is refused)) refuses."""
    for name, value in (extra or {}).items():
        rule = rules.get(name)
        if rule is not None and not any(value == ok and type(value) is type(ok) for ok in rule[0]):
            raise bad_request(f"{name}: {rule[1]}", param=name, code="unsupported_parameter")
