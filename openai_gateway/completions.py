"""``/v1/chat/completions`` and ``/v1/completions`` on the generation model.

A request becomes one Triton request to the model's vLLM-backend interface: the prompt (or
the chat messages as JSON with ``apply_chat_template``, rendered by the model's own
template), ``sampling_parameters`` JSON, and the flags that return the finish reason and
the token counts. Answers become OpenAI's objects; streams become its SSE chunks.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from openai_gateway.catalog import GenerationModel
from openai_gateway.embeddings import utf8
from openai_gateway.errors import APIError, bad_request, too_large
from openai_gateway.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from openai_gateway.settings import GatewaySettings

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_SEED = 2**63 - 1
# The engine's names for why a sequence ended; "abort" (cancelled) never reaches a client.
FINISH = {"stop": "stop", "length": "length"}


@dataclass
class GenerationJob:
    """A checked completion request, ready for Triton: the model's inputs and how to answer."""

    model: GenerationModel
    chat: bool
    text_input: str
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    echo_prefix: str = ""  # /v1/completions with echo: the prompt, sent before the answer
    max_tokens_defaulted: bool = False  # the request named no max_tokens: it may shrink to fit the context
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def completion_id(self) -> str:
        """The ``id`` of OpenAI's completion object."""
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id


def _refuse_unsupported(req: _Sampling) -> None:
    if req.n not in (None, 1):
        raise bad_request(f"n must be 1, got {req.n}: this server returns one choice per request", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value not in (None, 0):
            raise bad_request(f"{name} is not supported (only 0); repetition_penalty is", param=name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")


def _sampling(
    req: _Sampling, max_tokens: int | None, model: GenerationModel, settings: GatewaySettings, default_max_tokens: int
) -> dict[str, Any]:
    cap = min(model.max_tokens_limit, settings.max_tokens_cap or model.max_tokens_limit)
    param = (
        "max_completion_tokens"
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
        else "max_tokens"
    )
    if max_tokens is None:
        max_tokens = min(cap, default_max_tokens)
    elif max_tokens < 1:
        raise bad_request(f"{param} must be >= 1, got {max_tokens}", param=param)
    elif max_tokens > cap:
        raise bad_request(f"{param} must be <= {cap} ({model.id}'s max_tokens_limit), got {max_tokens}", param=param)
    out: dict[str, Any] = {"max_tokens": max_tokens}
    if req.temperature is not None:
        if not 0 <= req.temperature <= 2:
            raise bad_request(f"temperature must be between 0 and 2, got {req.temperature}", param="temperature")
        out["temperature"] = float(req.temperature)
    if req.top_p is not None:
        if not 0 < req.top_p <= 1:
            raise bad_request(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
        out["top_p"] = float(req.top_p)
    if req.seed is not None:
        if not 0 <= req.seed <= MAX_SEED:
            raise bad_request(f"seed must be between 0 and {MAX_SEED}, got {req.seed}", param="seed")
        out["seed"] = req.seed
    if req.stop is not None:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if len(stop) > settings.max_stop:
            raise bad_request(f"stop has {len(stop)} sequences; the limit is {settings.max_stop}", param="stop")
        for i, s in enumerate(stop):
            utf8(s, f"stop[{i}]")
            if not s:
                raise bad_request(f"stop[{i}] is empty", param="stop")
            if len(s) > settings.max_stop_chars:
                raise bad_request(f"stop[{i}] has {len(s)} characters; the limit is {settings.max_stop_chars}", param="stop")
        if stop:
            out["stop"] = stop
    if req.top_k is not None:
        # Above int64 the engine's sampler overflows and fails its whole batch step.
        if not 0 <= req.top_k <= MAX_SEED:
            raise bad_request(f"top_k must be between 0 (0 disables it) and {MAX_SEED}, got {req.top_k}", param="top_k")
        out["top_k"] = req.top_k
    if req.min_tokens is not None:
        if not 0 <= req.min_tokens <= max_tokens:
            raise bad_request(
                f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {req.min_tokens}", param="min_tokens"
            )
        out["min_tokens"] = req.min_tokens
    if req.repetition_penalty is not None:
        if not 0 < req.repetition_penalty <= 10:
            raise bad_request(f"repetition_penalty must be in (0, 10], got {req.repetition_penalty}", param="repetition_penalty")
        out["repetition_penalty"] = float(req.repetition_penalty)
    if req.ignore_eos is not None:
        out["ignore_eos"] = req.ignore_eos
    return out


def _include_usage(req: _Sampling) -> bool:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    return bool(req.stream_options and req.stream_options.include_usage)


def check_chat(req: ChatCompletionRequest, model: GenerationModel, settings: GatewaySettings) -> GenerationJob:
    """A chat completion request checked against OpenAI's policy and the model's limits, as a job;
    400/413 naming the field otherwise."""
    _refuse_unsupported(req)
    if req.logprobs or req.top_logprobs:
        raise bad_request("logprobs is not supported", param="logprobs")
    if req.tools or req.functions or req.tool_choice not in (None, "none"):
        raise bad_request("tools and function calling are not supported by this model", param="tools")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise bad_request('response_format must be {"type": "text"}: structured output is not supported', param="response_format")
    if not req.messages:
        raise bad_request("messages must not be empty", param="messages")
    if len(req.messages) > settings.max_messages:
        raise too_large(f"messages has {len(req.messages)} items; the limit is {settings.max_messages}", param="messages")
    messages = []
    chars = 0
    for i, m in enumerate(req.messages):
        role = ROLES.get(m.role)
        if role is None:
            raise bad_request(
                f"messages[{i}].role is {m.role!r}; expected one of {', '.join(ROLES)}", param=f"messages[{i}].role"
            )
        if isinstance(m.content, list):
            parts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}].content[{j}] is of type {part.type!r}; only text parts are supported",
                        param=f"messages[{i}].content[{j}].type",
                    )
                parts.append(part.text)
            content = "".join(parts)
        elif m.content is None:
            raise bad_request(f"messages[{i}].content is missing", param=f"messages[{i}].content")
        else:
            content = m.content
        chars += len(content)
        utf8(content, f"messages[{i}].content")
        messages.append({"role": role, "content": content})
    if chars > settings.max_prompt_chars:
        raise too_large(
            f"messages have {chars} characters together; the limit is {settings.max_prompt_chars} (--max-prompt-chars)",
            param="messages",
        )
    if not any(m["content"].strip() for m in messages):
        raise bad_request("every message is empty", param="messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    default = settings.default_max_tokens or model.max_tokens_limit
    sampling = _sampling(req, max_tokens, model, settings, default)
    text = orjson.dumps(messages).decode("utf-8")
    if len(text.encode("utf-8")) > model.max_text_bytes:
        raise too_large(
            f"messages take {len(text.encode('utf-8'))} bytes as JSON; {model.id}'s limit is "
            f"{model.max_text_bytes} (max_text_bytes in its config.pbtxt)",
            param="messages",
        )
    return GenerationJob(
        model, True, text, sampling, bool(req.stream), _include_usage(req), max_tokens_defaulted=max_tokens is None
    )


# /v1/completions without max_tokens generates 16 tokens, as OpenAI and vLLM do.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def check_completion(req: CompletionRequest, model: GenerationModel, settings: GatewaySettings) -> GenerationJob:
    """A text completion request checked as ``check_chat`` does, as a job (``max_tokens``
    16 unless the request or --default-max-tokens says otherwise)."""
    _refuse_unsupported(req)
    if req.best_of not in (None, 1):
        raise bad_request(f"best_of must be 1, got {req.best_of}", param="best_of")
    if req.logprobs is not None:
        raise bad_request("logprobs is not supported", param="logprobs")
    if req.suffix:
        raise bad_request("suffix is not supported by this model", param="suffix")
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise bad_request(
                "prompt must be one string (or a list of one string): token prompts and several "
                "prompts per request are not supported",
                param="prompt",
            )
        prompt = prompt[0]
    if not prompt.strip():
        raise bad_request("prompt is empty or only whitespace", param="prompt")
    utf8(prompt, "prompt")
    if len(prompt) > settings.max_prompt_chars:
        raise too_large(
            f"prompt has {len(prompt)} characters; the limit is {settings.max_prompt_chars} (--max-prompt-chars)", param="prompt"
        )
    if len(prompt.encode("utf-8")) > model.max_text_bytes:
        raise too_large(
            f"prompt has {len(prompt.encode('utf-8'))} bytes; {model.id}'s limit is "
            f"{model.max_text_bytes} (max_text_bytes in its config.pbtxt)",
            param="prompt",
        )
    default = settings.default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    sampling = _sampling(req, req.max_tokens, model, settings, default)
    return GenerationJob(
        model,
        False,
        prompt,
        sampling,
        bool(req.stream),
        _include_usage(req),
        echo_prefix=prompt if req.echo else "",
        max_tokens_defaulted=req.max_tokens is None,
    )


# The engine's refusal of prompt + max_tokens over the context (python_backends/generation/engine.py).
_CONTEXT = re.compile(r"the prompt has (\d+) tokens and max_tokens is (\d+): \d+ exceeds the context limit of (\d+)")


def fit_to_context(job: GenerationJob, error: APIError) -> GenerationJob | None:
    """The job again with max_tokens cut to the room the prompt leaves, when the request named
    no max_tokens and the engine refused the default for the context (as OpenAI's and vLLM's
    servers fill the rest of the context); None when that does not apply."""
    if not job.max_tokens_defaulted or error.status != 400:
        return None
    m = _CONTEXT.search(error.message)
    if m is None:
        return None
    prompt, limit = int(m.group(1)), int(m.group(3))
    room = limit - prompt
    if room < 1 or room >= job.sampling["max_tokens"]:
        return None
    return replace(job, sampling={**job.sampling, "max_tokens": room}, max_tokens_defaulted=False)


@dataclass
class Tally:
    """What a generation's pieces add up to so far: the finish reason and the token counts."""

    reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, piece) -> None:
        """Take the piece's reason and counts (the latest wins)."""
        self.reason = piece.finish_reason or self.reason
        if piece.prompt_tokens is not None:
            self.prompt_tokens = piece.prompt_tokens
        if piece.completion_tokens is not None:
            self.completion_tokens = piece.completion_tokens


def finish_reason(value: str | None) -> str | None:
    """The engine's finish reason in OpenAI's words."""
    return None if value is None else FINISH.get(value, "stop")


def usage(prompt: int, completion: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def whole_body(job: GenerationJob, text: str, reason: str | None, prompt_tokens: int, completion_tokens: int) -> bytes:
    """The JSON of a whole (non-streamed) chat or text completion."""
    base = {"id": job.completion_id, "created": job.created, "model": job.model.id, "system_fingerprint": None}
    if job.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish_reason(reason),
        }
        body = {**base, "object": "chat.completion", "choices": [choice]}
    else:
        choice = {"index": 0, "text": job.echo_prefix + text, "logprobs": None, "finish_reason": finish_reason(reason)}
        body = {**base, "object": "text_completion", "choices": [choice]}
    body["usage"] = usage(prompt_tokens, completion_tokens)
    return orjson.dumps(body)


class ChunkWriter:
    """The SSE events of one stream, in OpenAI's chunk format, ending with ``data: [DONE]``."""

    def __init__(self, job: GenerationJob):
        self.job = job
        self._head = {
            "id": job.completion_id,
            "created": job.created,
            "model": job.model.id,
            "system_fingerprint": None,
            "object": "chat.completion.chunk" if job.chat else "text_completion",
        }
        self._started = False

    def _event(self, choices: list, usage_value: Any = None, with_usage: bool | None = None) -> bytes:
        body = {**self._head, "choices": choices}
        if with_usage if with_usage is not None else self.job.include_usage:
            body["usage"] = usage_value
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _choice(self, text: str | None, reason: str | None, role: bool = False) -> dict:
        if self.job.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}

    def start(self) -> bytes:
        """The first event: the assistant role (chat) or the echoed prompt (completions)."""
        self._started = True
        if self.job.chat:
            return self._event([self._choice("", None, role=True)])
        return self._event([self._choice(self.job.echo_prefix, None)]) if self.job.echo_prefix else b""

    def text(self, piece: str) -> bytes:
        """The event of one text piece (nothing for an empty one)."""
        return self._event([self._choice(piece, None)]) if piece else b""

    def finish(self, reason: str | None, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The last events: the finish reason, the usage when asked for, ``[DONE]``."""
        out = self._event([self._choice(None if self.job.chat else "", finish_reason(reason) or "stop")])
        if self.job.include_usage:
            out += self._event([], usage(prompt_tokens, completion_tokens))
        return out + b"data: [DONE]\n\n"

    @staticmethod
    def error(body: dict) -> bytes:
        """An error after the stream began (the status is already sent): OpenAI's error object as an event."""
        return b"data: " + orjson.dumps(body) + b"\n\n"
