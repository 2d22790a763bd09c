"""``/v1/chat/completions`` and ``/v1/completions`` on the generation model.

A request becomes one Triton request to the model's vLLM-backend interface: the prompt (or
the chat messages as JSON with ``apply_chat_template``, rendered by the model's own
template), ``sampling_parameters`` JSON, and the flags that return the finish reason and
the token counts. Answers become OpenAI's objects; streams become its SSE chunks.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from contract.errors import InputError
from contract.sampling import GUIDE_FIELDS, MAX_LOGPROBS, SAMPLING_FIELDS, structural_tag_grammar
from openai_gateway.catalog import GenerationModel
from openai_gateway.embeddings import utf8
from openai_gateway.errors import bad_request, too_large
from openai_gateway.request_fields import refuse_unserved
from openai_gateway.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from openai_gateway.settings import GatewaySettings
from openai_gateway.tools import ToolStream, ToolUse, check_tools, closed, render_message

MAX_TOP_LOGPROBS = MAX_LOGPROBS  # chat's top_logprobs: OpenAI's 20, the engine's limit too
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs: OpenAI's legacy limit
# Fields whose OpenAI meaning differs from the engine's: the checks below map them.
_MAPPED = ("logprobs",)

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
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
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: the usage so far on every chunk
    echo_prefix: str = ""  # /v1/completions with echo: the prompt, sent before the answer
    prompt_token_ids: tuple[int, ...] = ()  # a prompt of token ids (text_input is then their text)
    prompt_logprobs: bool = False  # echo with logprobs: the prompt's tokens lead the choice's logprobs
    first_index: int = 0  # the index of this prompt's first choice (a list of prompts: prompt i's is i * n)
    siblings: list[GenerationJob] = field(default_factory=list)  # the jobs of the list's other prompts
    logprobs: bool = False  # the answer carries log-probabilities (sampling["logprobs"] alternatives each)
    tools: ToolUse | None = None  # the functions the answer may call (openai_gateway/tools.py)
    fields: dict[str, str] = field(default_factory=dict)  # the model's field names -> the request's (errors' param)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def completion_id(self) -> str:
        """The ``id`` of OpenAI's completion object."""
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    @property
    def n(self) -> int:
        """Choices asked for (the engine forks them from one prefill and checks the number)."""
        return int(self.sampling.get("n") or 1)


def _sampling(
    req: _Sampling, max_tokens: int | None, settings: GatewaySettings, default_max_tokens: int | None
) -> dict[str, Any]:
    """The request's sampling fields for the engine (contract/sampling.py),
    which judges their values; here only OpenAI's own policy and the operator's cap are
    checked. Without max_tokens the engine fills the rest of the context, up to the default."""
    param = (
        "max_completion_tokens"
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
        else "max_tokens"
    )
    out: dict[str, Any] = {
        f.name: getattr(req, f.name) for f in SAMPLING_FIELDS if f.name not in _MAPPED and getattr(req, f.name, None) is not None
    }
    cap = settings.max_tokens_cap
    if max_tokens is None:
        # None (null): the model's max_tokens_limit, as the engine reads it; the cap lowers either.
        limits = [n for n in (default_max_tokens, cap) if n]
        out["max_tokens"] = min(limits) if limits else None
        out["fit_to_context"] = True
    else:
        if cap and max_tokens > cap:
            raise bad_request(f"{param} must be <= {cap} (--max-tokens-cap), got {max_tokens}", param=param)
        out["max_tokens"] = max_tokens
    if req.temperature is not None:
        if not 0 <= req.temperature <= 2:  # OpenAI's range; the engine takes any temperature >= 0
            raise bad_request(f"temperature must be between 0 and 2, got {req.temperature}", param="temperature")
        out["temperature"] = float(req.temperature)
    if req.stop is not None:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if len(stop) > settings.max_stop:  # OpenAI's 4; the engine's own limit is higher
            raise bad_request(f"stop has {len(stop)} sequences; the limit is {settings.max_stop}", param="stop")
        for i, s in enumerate(stop):
            utf8(s, f"stop[{i}]")
        if stop:
            out["stop"] = stop
        else:
            out.pop("stop")
    return out


def _include_usage(req: _Sampling) -> bool:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    return bool(req.stream_options and req.stream_options.include_usage)


def _continuous_usage(req: _Sampling) -> bool:
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


def plain_message(m: Any, i: int) -> dict[str, str]:
    """A system, user or assistant message as the model's template takes it (role mapped, text
    parts joined, valid UTF-8); 400 naming the part that is not."""
    role = ROLES.get(m.role)
    if role is None:
        raise bad_request(f"messages[{i}].role is {m.role!r}; expected one of {', '.join(ROLES)}", param=f"messages[{i}].role")
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
    utf8(content, f"messages[{i}].content")
    return {"role": role, "content": content}


def check_chat(req: ChatCompletionRequest, model: GenerationModel, settings: GatewaySettings) -> GenerationJob:
    """A chat completion request checked against OpenAI's policy and the gateway's own limits, as a
    job; 400/413 naming the field otherwise. The model judges the rest (its errors come back as data)."""
    refuse_unserved(req.model_extra, chat=True)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}", param="top_logprobs"
            )
    if req.functions or req.function_call is not None:
        raise bad_request("functions and function_call are superseded: send tools and tool_choice", param="functions")
    tool_use = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    if len(req.messages) > settings.max_messages:
        raise too_large(f"messages has {len(req.messages)} items; the limit is {settings.max_messages}", param="messages")
    messages = []
    chars = 0
    call_names: dict[str, str] = {}
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list) and m.role == "tool":  # a tool result in text parts
            m = m.model_copy(update={"content": "".join(p.text or "" for p in m.content)})
        rendered = render_message(m, i, call_names)
        if rendered is not None:
            chars += len(rendered["content"])
            utf8(rendered["content"], f"messages[{i}].content")
            messages.append(rendered)
            continue
        message = plain_message(m, i)
        chars += len(message["content"])
        messages.append(message)
    if chars > settings.max_prompt_chars:
        raise too_large(
            f"messages have {chars} characters together; the limit is {settings.max_prompt_chars} (--max-prompt-chars)",
            param="messages",
        )
    if tool_use is not None:  # the functions, as the fallback prompt lists them, before the conversation
        listing = tool_use.system_prompt()
        utf8(listing, "tools")
        messages.insert(0, {"role": "system", "content": listing})
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = _sampling(req, max_tokens, settings, settings.default_max_tokens or None)
    if req.logprobs:
        sampling["logprobs"] = req.top_logprobs or 0
    text = orjson.dumps(messages).decode("utf-8")
    fields = {
        "text_input": "messages",
        "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
    }
    schema = _guide_from_response_format(req.response_format, sampling, fields)
    if tool_use is not None and tool_use.enforced:
        if schema is not None:
            raise bad_request(
                "response_format cannot be enforced beside tool_choice required or a named function", param="response_format"
            )
        sampling["guided_json"] = tool_use.schema()
        fields["guided_json"] = "tools"
    return GenerationJob(
        model,
        True,
        text,
        sampling,
        bool(req.stream),
        _include_usage(req),
        fields=fields,
        logprobs=bool(req.logprobs),
        tools=tool_use,
        continuous_usage=_continuous_usage(req),
    )


def _guide_from_response_format(value: dict[str, Any] | None, sampling: dict[str, Any], fields: dict[str, str]) -> Any:
    """``response_format``'s schema as the job's guide (the engine compiles and enforces it; its
    errors name guided_json, reported as response_format); 400 beside another guide. vLLM's
    ``structural_tag`` type becomes a Lark guide (free text, the tag's schema after a trigger)."""
    if value and value.get("type") == "structural_tag":
        try:
            grammar = structural_tag_grammar({k: v for k, v in value.items() if k != "type"}, "response_format")
        except InputError as exc:
            raise bad_request(str(exc), param=exc.field) from None
        _one_guide(sampling)
        sampling["guided_grammar"] = grammar
        fields["guided_grammar"] = "response_format"
        return grammar
    schema = response_format_schema(value)
    if schema is not None:
        _one_guide(sampling)
        sampling["guided_json"] = schema
        fields["guided_json"] = "response_format"
    return schema


def _one_guide(sampling: dict[str, Any]) -> None:
    other = next((name for name in (*GUIDE_FIELDS, "structured_outputs") if name in sampling), None)
    if other is not None:
        raise bad_request(f"response_format cannot be combined with {other}: one guide per request", param="response_format")


def response_format_schema(value: dict[str, Any] | None) -> Any:
    """The JSON schema a chat's ``response_format`` asks for: None for text, any JSON object for
    ``json_object``, ``json_schema.schema`` for ``json_schema`` (enforced whether or not
    ``strict``, its objects closed unless they say otherwise); 400 naming the part that is wrong."""
    if not value or value.get("type") in (None, "text"):
        return None
    kind = value.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be text, json_object or json_schema, got {str(kind)[:40]!r}", param="response_format.type"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with a schema", param="response_format.json_schema")
    schema = spec.get("schema", {})  # OpenAI: absent means any JSON object
    if not isinstance(schema, dict):
        raise bad_request(
            "response_format.json_schema.schema must be a JSON schema object", param="response_format.json_schema.schema"
        )
    # Objects that do not say otherwise take only their listed properties (OpenAI's strict mode
    # requires that of the schema; enforced, an open object lets a small model add keys forever).
    return closed(schema) if schema else {"type": "object"}


# /v1/completions without max_tokens generates 16 tokens, as OpenAI and vLLM do.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


# Prompts of one /v1/completions request (a list of strings or of token arrays): each is a Triton request.
MAX_PROMPTS = 256


def _prompts(prompt: Any, tokenizer: Any, settings: GatewaySettings) -> list[str | list[int]]:
    """The request's prompts, each a string or a token array checked against the vocabulary
    (``tokenizer``: the model's ModelTokenizer; None where the gateway has none, and then no
    token prompt is taken); 400/413 naming ``prompt`` otherwise."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]  # one token array
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt is an empty list", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise too_large(f"prompt has {len(prompts)} prompts; the limit is {MAX_PROMPTS}", param="prompt")
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            utf8(p, where)
            if len(p) > settings.max_prompt_chars:
                raise too_large(
                    f"{where} has {len(p)} characters; the limit is {settings.max_prompt_chars} (--max-prompt-chars)",
                    param="prompt",
                )
            continue
        if not p:
            raise bad_request(f"{where} is an empty token array", param="prompt")
        if tokenizer is None:
            raise bad_request("token prompts need the model's tokenizer, which this gateway has not loaded", param="prompt")
        bad = next((t for t in p if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise bad_request(f"{where} holds token id {bad}, outside the vocabulary [0, {tokenizer.vocab_size})", param="prompt")
        if len(p) > settings.max_prompt_chars:
            raise too_large(f"{where} has {len(p)} tokens; the limit is {settings.max_prompt_chars}", param="prompt")
    return prompts


def check_completion(
    req: CompletionRequest, model: GenerationModel, settings: GatewaySettings, tokenizer: Any = None
) -> GenerationJob:
    """A text completion request checked as ``check_chat`` does, as a job (``max_tokens``
    16 unless the request or --default-max-tokens says otherwise). A list of prompts gives one
    job per prompt (the first's ``siblings``); ``tokenizer`` (the model's ModelTokenizer) checks
    and decodes token prompts."""
    refuse_unserved(req.model_extra, chat=False)
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request(f"best_of must equal n ({req.n or 1}), got {req.best_of}: every choice is returned", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {req.logprobs}", param="logprobs")
    if req.suffix:
        raise bad_request("suffix is not supported by this model", param="suffix")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be > 0 (0 only with echo: the prompt's log-probabilities)", param="max_tokens")
    prompts = _prompts(req.prompt, tokenizer, settings)
    if len(prompts) > 1 and req.stream:
        raise bad_request("stream: true takes one prompt; send a list of prompts without streaming", param="stream")
    sampling = _sampling(req, req.max_tokens, settings, settings.default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)
    if req.logprobs is not None:
        sampling["logprobs"] = req.logprobs
    # echo: the prompt's tokens in the logprobs too (OpenAI's legacy answer: the first one's null);
    # max_tokens 0 asks for the prompt alone, which the engine serves only with them.
    prompt_logprobs = bool(req.echo) and (req.logprobs is not None or req.max_tokens == 0)
    if prompt_logprobs:
        sampling["prompt_logprobs"] = req.logprobs or 0
    fields = {"text_input": "prompt"}
    _guide_from_response_format(req.response_format, sampling, fields)  # vLLM takes chat's response_format here too
    jobs = []
    for i, p in enumerate(prompts):
        text = p if isinstance(p, str) else tokenizer.tokenizer.decode(p, skip_special_tokens=False)
        jobs.append(
            GenerationJob(
                model,
                False,
                text,
                sampling,
                bool(req.stream),
                _include_usage(req),
                echo_prefix=text if req.echo else "",
                prompt_token_ids=() if isinstance(p, str) else tuple(p),
                prompt_logprobs=prompt_logprobs,
                first_index=i * (req.n or 1),
                fields=fields,
                continuous_usage=_continuous_usage(req),
                logprobs=req.logprobs is not None,
            )
        )
    jobs[0].siblings = jobs[1:]
    return jobs[0]


@dataclass
class Tally:
    """What a generation's pieces add up to so far: the finish reason and the token counts."""

    reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # of the prompt's, in the engine's prefix cache
    fitted: bool = False  # fit_structure_to_max_tokens steered the answer to close (the choice's structure_fitted)
    logprobs: list[dict] = field(default_factory=list)  # OpenAI's token objects of every piece so far
    prompt_logprobs: list[dict | None] | None = None  # the prompt's (echo), with the choice's first piece

    def add(self, piece) -> None:
        """Take the piece's reason, counts (the latest wins) and log-probabilities."""
        self.fitted = self.fitted or getattr(piece, "structure_fitted", False)
        if piece.logprobs:
            self.logprobs.extend(piece.logprobs)
        if getattr(piece, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = piece.prompt_logprobs
        self.reason = piece.finish_reason or self.reason
        if piece.prompt_tokens is not None:
            self.prompt_tokens = piece.prompt_tokens
        if piece.completion_tokens is not None:
            self.completion_tokens = piece.completion_tokens
        if piece.cached_tokens is not None:
            self.cached_tokens = piece.cached_tokens

    @property
    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens`` when the model said."""
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return out


class Tallies:
    """The tallies of a request's choices (``n`` > 1: each piece says its choice), and their usage."""

    def __init__(self) -> None:
        self.by_index: dict[int, Tally] = {}

    def add(self, piece) -> Tally:
        """Add the piece to its choice's tally; returns that tally."""
        tally = self.of(piece.index)
        tally.add(piece)
        return tally

    def of(self, index: int) -> Tally:
        return self.by_index.setdefault(index, Tally())

    @property
    def prompt_tokens(self) -> int:
        return max((t.prompt_tokens for t in self.by_index.values()), default=0)

    @property
    def completion_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.by_index.values())

    @property
    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage``: the prompt once, the tokens of every choice."""
        cached = [t.cached_tokens for t in self.by_index.values() if t.cached_tokens is not None]
        return Tally(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, cached_tokens=max(cached, default=None)
        ).usage


def finish_reason(value: str | None) -> str | None:
    """The engine's finish reason in OpenAI's words."""
    return None if value is None else FINISH.get(value, "stop")


def chat_logprobs(entries: list[dict]) -> dict:
    """A chat choice's ``logprobs``: the model's token objects as OpenAI's ``content``."""
    return {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """A text completion choice's legacy ``logprobs``; ``offset``: where the first token's text
    starts in the choice's text (after an echoed prompt, or earlier chunks). An echoed prompt's
    first token has a null logprob and null top_logprobs (nothing precedes it)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries
        ],
        "text_offset": offsets,
    }


def prompt_entries(prompt: str, entries: list[dict | None]) -> list[dict]:
    """The model's prompt entries (the first None) as token objects: the first token's text is
    what the prompt holds before the bytes of the others."""
    rest = entries[1:]
    raw = prompt.encode("utf-8")
    head = raw[: max(0, len(raw) - sum(len(e["bytes"]) for e in rest if e is not None))]
    first = {"token": head.decode("utf-8", errors="replace"), "logprob": None, "bytes": list(head), "top_logprobs": None}
    return [first, *(e for e in rest if e is not None)]


def _whole_choice(job: GenerationJob, index: int, text: str, tally: Tally) -> dict[str, Any]:
    """One choice of a whole answer, with ``structure_fitted: true`` when the engine steered it to close."""
    return _fitted(_choice_body(job, index, text, tally), tally)


def _fitted(choice: dict[str, Any], tally: Tally) -> dict[str, Any]:
    if tally.fitted:  # the key only then: answers without the option are as before
        choice["structure_fitted"] = True
    return choice


def _choice_body(job: GenerationJob, index: int, text: str, tally: Tally) -> dict[str, Any]:
    if job.chat:
        calls: list[dict] | None = None
        if job.tools is not None:  # the stream's rules, so a whole answer says what its stream would
            stream = ToolStream(job.tools)
            content, sent = stream.feed(text)
            rest, more = stream.finish()
            calls, text = sent + more, content + rest
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if calls:
            message = {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}
        return {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(tally.logprobs) if job.logprobs else None,
            "finish_reason": "tool_calls" if calls and tally.reason != "length" else finish_reason(tally.reason),
        }
    logprobs = None
    if job.logprobs and job.prompt_logprobs:
        logprobs = completion_logprobs(prompt_entries(job.echo_prefix, tally.prompt_logprobs or [None]) + tally.logprobs, 0)
    elif job.logprobs:
        logprobs = completion_logprobs(tally.logprobs, len(job.echo_prefix))
    return {"index": index, "text": job.echo_prefix + text, "logprobs": logprobs, "finish_reason": finish_reason(tally.reason)}


def whole_body(job: GenerationJob, texts: dict[int, str], tallies: Tallies | list[Tallies]) -> bytes:
    """The JSON of a whole (non-streamed) chat or text completion: one choice per index. A list
    of prompts: ``tallies`` holds each job's (the first's, then its siblings'), indexed as the
    answer numbers its choices, and the usage adds up their prompts."""
    base = {"id": job.completion_id, "created": job.created, "model": job.model.id, "system_fingerprint": None}
    groups = list(zip([job, *job.siblings], tallies if isinstance(tallies, list) else [tallies]))
    choices = [
        _whole_choice(j, i, texts.get(i, ""), t.of(i)) for j, t in groups for i in range(j.first_index, j.first_index + j.n)
    ]
    body = {**base, "object": "chat.completion" if job.chat else "text_completion", "choices": choices}
    usages = [t.usage for _, t in groups]
    usage = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages if "prompt_tokens_details" in u]
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
    body["usage"] = usage if len(usages) > 1 else usages[0]
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
        # Per choice: completions' offset of the next token's text; an answer that may be calls.
        self._offset = {i: len(job.echo_prefix) for i in range(job.n)}
        self._tools = {i: ToolStream(job.tools) for i in range(job.n)} if job.tools is not None else None
        self._finished: set[int] = set()

    def _event(self, choices: list, usage_value: Any = None, with_usage: bool | None = None) -> bytes:
        body = {**self._head, "choices": choices}
        if with_usage if with_usage is not None else self.job.include_usage:
            body["usage"] = usage_value
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _choice(
        self, index: int, text: str | None, reason: str | None, role: bool = False, logprobs: list[dict] | None = None
    ) -> dict:
        if self.job.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            lp = chat_logprobs(logprobs) if logprobs is not None else None
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        lp = None
        if logprobs is not None:
            lp = completion_logprobs(logprobs, self._offset[index])
            self._offset[index] += sum(len(e["token"]) for e in logprobs)
        return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}

    def start(self, first: Any = None) -> bytes:
        """The first events: each choice's assistant role (chat) or echoed prompt (completions);
        ``first``: the stream's first piece, whose prompt entries an echo with logprobs carries."""
        self._started = True
        if self.job.chat:
            return b"".join(self._event([self._choice(i, "", None, role=True)]) for i in range(self.job.n))
        if not self.job.echo_prefix:
            return b""
        if self.job.prompt_logprobs and self.job.logprobs:  # the prompt's tokens, its text's offsets from 0
            entries = prompt_entries(self.job.echo_prefix, getattr(first, "prompt_logprobs", None) or [None])
            self._offset = dict.fromkeys(self._offset, 0)
            return b"".join(
                self._event([self._choice(i, self.job.echo_prefix, None, logprobs=entries)]) for i in range(self.job.n)
            )
        return b"".join(self._event([self._choice(i, self.job.echo_prefix, None)]) for i in range(self.job.n))

    def text(self, piece: str, logprobs: list[dict] | None = None, index: int = 0, usage: Any = None) -> bytes:
        """The event of one text piece of choice ``index`` and its tokens' log-probabilities when
        asked for (nothing for an empty piece without any); ``usage``: the usage so far, on the
        chunk (continuous_usage_stats)."""
        if not piece and not logprobs:
            return b""
        if self._tools is not None:  # content as it comes once it is known not to be calls; calls one by one
            content, calls = self._tools[index].feed(piece)
            return self._calls_and_content(index, content, calls)
        choice = self._choice(index, piece, None, logprobs=(logprobs or []) if self.job.logprobs else None)
        return self._event([choice], usage, with_usage=True) if usage is not None else self._event([choice])

    def _calls_and_content(self, index: int, content: str, calls: list[dict]) -> bytes:
        out = self._event([self._choice(index, content, None)]) if content else b""
        if calls:
            first = self._tools[index].sent - len(calls) if self._tools is not None else 0
            deltas = [{"index": first + i, **call} for i, call in enumerate(calls)]
            out += self._event([{"index": index, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None}])
        return out

    def finish_choice(self, index: int, tally: Tally) -> bytes:
        """The events that end choice ``index``: held tool calls or text, then its finish reason
        (nothing when it was ended already)."""
        if index in self._finished:
            return b""
        self._finished.add(index)
        out = b""
        reason = finish_reason(tally.reason) or "stop"
        if self._tools is not None:
            content, calls = self._tools[index].finish()
            out += self._calls_and_content(index, content, calls)
            if self._tools[index].sent and reason != "length":
                reason = "tool_calls"
        return out + self._event([_fitted(self._choice(index, None if self.job.chat else "", reason), tally)])

    def finish(self, tallies: Tallies) -> bytes:
        """The last events: the finish of every choice not ended yet, the usage when asked for, ``[DONE]``."""
        out = b"".join(self.finish_choice(i, tallies.of(i)) for i in range(self.job.n))
        if self.job.include_usage:
            out += self._event([], tallies.usage)
        return out + b"data: [DONE]\n\n"

    @staticmethod
    def error(body: dict) -> bytes:
        """An error after the stream began (the status is already sent): OpenAI's error object as an event."""
        return b"data: " + orjson.dumps(body) + b"\n\n"
