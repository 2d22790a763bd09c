"""OpenAI's Responses API (``/v1/responses``) over the chat completions path.

A request becomes a chat completion request, checked by ``completions.check_chat`` as any chat
is: ``instructions`` the system message; the input items (a string, messages with
``input_text`` parts, ``function_call`` and ``function_call_output`` items) the conversation;
``text.format`` chat's ``response_format``; the flat function tools chat's tools;
``max_output_tokens`` chat's ``max_completion_tokens``. Errors of those checks name the
Responses field (``messages[2].content`` -> ``input[1].content``). The answer, whole or
streamed, goes through ``ResponseWriter``: the text and the calls (``tools.ToolStream``, so prose
streams as it comes beside tools) as output items, each change as a typed event.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationError

from contract.sampling import SAMPLING_FIELDS
from openai_gateway.catalog import GenerationModel
from openai_gateway.completions import GenerationJob, Tallies, check_chat
from openai_gateway.errors import APIError, bad_request
from openai_gateway.request_fields import IGNORED, UNSERVED, refuse_listed
from openai_gateway.schemas import ChatCompletionRequest, Number, _Body
from openai_gateway.settings import GatewaySettings
from openai_gateway.tools import ToolStream

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA = 16  # OpenAI's limits on metadata: pairs, key and value characters
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


class ResponsesRequest(_Body):
    """The body of `POST /v1/responses`: the fields served (the refused ones are listed in
    ``RESPONSES_UNSERVED``)."""

    model_config = {"extra": "allow"}  # undeclared fields are judged (refuse_listed), not dropped unseen

    model: StrictStr
    input: StrictStr | list[dict[str, Any]] = Field(
        description="A text (one user message) or a list of items: messages (text parts), function_call and "
        "function_call_output items"
    )
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    text: dict[str, Any] | None = Field(None, description="`format`: text, json_object or json_schema")
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    stream: StrictBool | None = False
    stream_options: dict[str, Any] | None = None
    store: StrictBool | None = True
    previous_response_id: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    truncation: StrictStr | None = Field(None, description="disabled (default): an input over the context is refused")
    include: list[StrictStr] | None = Field(None, description=f"{LOGPROBS_INCLUDE!r} only")
    top_logprobs: StrictInt | None = None
    reasoning: dict[str, Any] | None = Field(None, description="this model does not reason: effort and summary must be null")


_NONE: tuple[Any, ...] = (None,)
# Fields of OpenAI's Responses API (and chat's names sent to it) that ask for what is not served here.
RESPONSES_UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((None, False), "background responses are not served"),
    "background_options": ((None, {}), "background responses are not served"),
    "conversation": (_NONE, "conversations are not served; chain responses with previous_response_id"),
    "prompt": (_NONE, "stored prompt templates are not served"),
    "context_management": ((None, []), "context management (compaction) is not served"),
    "image": ((None, {}), "only text is served"),
    "access_programs": ((None, {}), "access programs are not served"),
    "max_tool_calls": (_NONE, "max_tool_calls is not served; use parallel_tool_calls: false for one call"),
    "max_tokens": (_NONE, "the Responses API's field is max_output_tokens"),
    "max_completion_tokens": (_NONE, "the Responses API's field is max_output_tokens"),
    "response_format": (_NONE, "the Responses API's field is text.format"),
    "messages": (_NONE, "the Responses API takes input (and instructions)"),
    "n": ((None, 1), "one output per response; chat completions serve n > 1"),
    "logprobs": ((None, False), f"send include: [{LOGPROBS_INCLUDE!r}] (and top_logprobs)"),
    "functions": (_NONE, "send tools"),
    "function_call": (_NONE, "send tool_choice"),
}
# The engine's sampling extensions (vLLM's top_k, seed, stop, ...) that go to the chat request as
# they are; chat's refused and ignored fields go too, and are refused or ignored there as on chat.
_PASSED = ({f.name for f in SAMPLING_FIELDS} | set(UNSERVED) | set(IGNORED)) - set(RESPONSES_UNSERVED) - {"temperature", "top_p"}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def unsupported(param: str, why: str) -> APIError:
    return bad_request(f"{param}: {why}", param=param, code="unsupported_parameter")


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message), messages given an id, their
    type and a text content as one text part, as OpenAI stores and lists them."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    out = []
    for item in items:
        if item.get("type", "message") == "message":
            item = {"type": "message", **item}
            if isinstance(item.get("content"), str):
                if item.get("role") == "assistant":
                    item["content"] = [{"type": "output_text", "text": item["content"], "annotations": []}]
                else:
                    item["content"] = [{"type": "input_text", "text": item["content"]}]
            if item.get("role") in ("user", "system", "developer"):
                item.setdefault("id", new_id("msg_"))
        out.append(item)
    return out


def _text_of(content: Any, where: str) -> str:
    """A message's content as one text: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            shown = str(kind)[:40] if isinstance(kind, str) else type(part).__name__
            raise bad_request(
                f"{where}[{j}] is of type {shown!r}; only input_text and output_text parts with a text are served",
                param=f"{where}[{j}].type",
            )
        parts.append(part["text"])
    return "".join(parts)


def chat_messages(items: list[dict[str, Any]], first: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Chat messages of the input items, and for each the Responses field it came from.
    ``first``: the index of the request's own first item (items before it came from
    previous_response_id's chain). Consecutive function calls are one assistant turn."""

    def where(i: int) -> str:
        return f"input[{i - first}]" if i >= first else "previous_response_id"

    messages: list[dict[str, Any]] = []
    origin: list[str] = []
    calls: list[dict[str, Any]] | None = None  # the assistant turn the last function_call item opened
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"{where(i)} must be an object", param=where(i))
        kind = item.get("type", "message")
        if kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where(i)}.{key} must be a string", param=f"{where(i)}.{key}")
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            if calls is None:
                calls = []
                messages.append({"role": "assistant", "content": None, "tool_calls": calls})
                origin.append(where(i))
            calls.append(call)
            continue
        calls = None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(
                    f"{where(i)}.role is {str(role)[:40]!r}; expected user, assistant, system or developer",
                    param=f"{where(i)}.role",
                )
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where(i)}.content")})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where(i)}.call_id must be a string", param=f"{where(i)}.call_id")
            output = _text_of(item.get("output"), f"{where(i)}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            shown = str(kind)[:40] if isinstance(kind, str) else type(kind).__name__
            raise bad_request(
                f"{where(i)}.type is {shown!r}; served: message, function_call, function_call_output",
                param=f"{where(i)}.type",
                code="unsupported_parameter",
            )
        origin.append(where(i))
    if not messages:
        raise bad_request("input has no items", param="input")
    return messages, origin


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in chat's shape; 400 naming a tool of another type."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}].type is {str(tool.get('type'))[:40]!r}; only function tools are served",
                param=f"tools[{i}].type",
                code="unsupported_parameter",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (json_schema's flat fields nested again)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


# A chat check's param -> the Responses field it came from.
_PARAMS = (
    (re.compile(r"^response_format\.json_schema"), "text.format"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
)


def responses_param(param: str | None, origin: list[str]) -> str | None:
    """The Responses field of a chat check's ``param``."""
    if param is None:
        return None
    found = re.match(r"^messages\[(\d+)\](.*)$", param)
    if found:
        k, rest = int(found.group(1)), found.group(2)
        if k >= len(origin):
            return "input"
        return origin[k] + (rest if rest.startswith(".content") else "")
    if param == "messages":
        return "input"
    for pattern, repl in _PARAMS:
        if pattern.match(param):
            return pattern.sub(repl, param, count=1)
    return param


def _check_fields(req: ResponsesRequest) -> dict[str, Any]:
    """Refuse what is not served, naming it; the extra fields that go on to the chat request."""
    extra = req.model_extra or {}
    refuse_listed(extra, RESPONSES_UNSERVED)
    if req.truncation not in (None, "disabled"):
        if req.truncation == "auto":
            raise unsupported("truncation", "auto is not served: an input over the context is refused (context_length_exceeded)")
        raise bad_request(f"truncation must be auto or disabled, got {req.truncation[:40]!r}", param="truncation")
    for key, value in (req.text or {}).items():
        if key != "format" and value is not None:
            raise unsupported(f"text.{key}", "only text.format is served")
    reasoning = req.reasoning or {}
    for key, value in reasoning.items():
        if value is not None:
            raise unsupported(f"reasoning.{key}", "this model does not reason")
    for i, name in enumerate(req.include or ()):
        if name != LOGPROBS_INCLUDE:
            raise unsupported(f"include[{i}]", f"{name[:60]!r} is not served; served: {LOGPROBS_INCLUDE!r}")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_request(f"top_logprobs must be between 0 and 20, got {req.top_logprobs}", param="top_logprobs")
    meta = req.metadata or {}
    if len(meta) > MAX_METADATA:
        raise bad_request(f"metadata has {len(meta)} pairs; the limit is {MAX_METADATA}", param="metadata")
    for key, value in meta.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise bad_request(
                f"metadata keys are at most {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE}", param="metadata"
            )
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    return {k: v for k, v in extra.items() if k in _PASSED}


def check_response(
    req: ResponsesRequest, context: list[dict[str, Any]], model: GenerationModel, settings: GatewaySettings
) -> tuple[GenerationJob, list[dict[str, Any]]]:
    """A Responses request checked as a chat completion, as a job; and every input item the
    answer is generated from (``context``, the previous response's, then the request's own).
    400/413 naming the Responses field otherwise."""
    passed = _check_fields(req)
    items = context + input_items(req.input)
    messages, origin = chat_messages(items, len(context))
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
        origin.insert(0, "instructions")
    body: dict[str, Any] = {
        **passed,
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "stream": bool(req.stream),
        "user": req.user,
    }
    if LOGPROBS_INCLUDE in (req.include or ()):
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # an engine field passed on (seed, top_k, ...) of the wrong type
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise APIError(422, f"Invalid request: {field}: {first['msg']}", param=field, code="invalid_request") from None
    try:
        job = check_chat(chat, model, settings)
    except APIError as exc:
        param = responses_param(exc.param, origin)
        if exc.param and param != exc.param:
            exc.message = exc.message.replace(exc.param, param or "")
        exc.param = param
        raise
    job.fields = {k: responses_param(v, origin) or v for k, v in job.fields.items()}
    job.fields["text_input"] = "input"
    return job, items


def usage(tallies: Tallies) -> dict[str, Any]:
    """The Responses API's ``usage`` of chat's tallies (cached: the engine's prefix-cache hits)."""
    chat = tallies.usage
    cached = chat.get("prompt_tokens_details", {}).get("cached_tokens") or 0
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


class ResponseWriter:
    """One response as it is generated: ``feed`` the text pieces, then ``finish`` (or ``fail``);
    each returns the typed events of what changed (``sequence_number`` in order), and
    ``response`` is OpenAI's Response object as it stands."""

    def __init__(self, job: GenerationJob, req: ResponsesRequest):
        self.job = job
        self.seq = 0
        self._tools = ToolStream(job.tools) if job.tools is not None else None
        self._message: dict[str, Any] | None = None  # the message item being written
        self._text: list[str] = []
        self._logprobs: list[dict] = []
        self.response: dict[str, Any] = {
            "id": new_id("resp_"),
            "object": "response",
            "created_at": job.created,
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": job.model.id,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": req.store is not False,
            "temperature": req.temperature,  # None: the model's generation config
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        """response.created and response.in_progress."""
        return [
            self._event("response.created", response=self.snapshot()),
            self._event("response.in_progress", response=self.snapshot()),
        ]

    def snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": list(self.response["output"])}

    def feed(self, piece: str, logprobs: list[dict] | None = None) -> list[dict[str, Any]]:
        """The events of one piece of the answer: text deltas, or whole function calls."""
        if self._tools is None:
            return self._content(piece, logprobs)
        content, calls = self._tools.feed(piece)
        if logprobs:
            self._logprobs.extend(logprobs)
        return self._content(content, None) + [e for call in calls for e in self._call(call)]

    def _content(self, text: str, logprobs: list[dict] | None) -> list[dict[str, Any]]:
        if not text:
            if logprobs:
                self._logprobs.extend(logprobs)
            return []
        events = []
        if self._message is None:
            events = self._open_message()
        assert self._message is not None
        self._text.append(text)
        if logprobs:
            self._logprobs.extend(logprobs)
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self._message["id"],
                output_index=len(self.response["output"]) - 1,
                content_index=0,
                delta=text,
                logprobs=logprobs or [],
            )
        )
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        self.response["output"].append(self._message)
        index = len(self.response["output"]) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", output_index=index, item=dict(self._message)),
            self._event(
                "response.content_part.added", item_id=self._message["id"], output_index=index, content_index=0, part=part
            ),
        ]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message = self._message
        if message is None:
            return []
        self._message = None
        index = self.response["output"].index(message)
        text = "".join(self._text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self._logprobs if self.job.logprobs else []}
        message.update(status=status, content=[part])
        common = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **common, text=text, logprobs=part["logprobs"]),
            self._event("response.content_part.done", **common, part=part),
            self._event("response.output_item.done", output_index=index, item=message),
        ]

    def _call(self, call: dict) -> list[dict[str, Any]]:
        events = self._close_message("completed")  # a call after prose (a held answer): the prose first
        fn = call["function"]
        item = {"id": new_id("fc_"), "type": "function_call", "call_id": call["id"], "name": fn["name"], "arguments": ""}
        item["status"] = "in_progress"
        self.response["output"].append(item)
        index = len(self.response["output"]) - 1
        common = {"item_id": item["id"], "output_index": index}
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        events.append(self._event("response.function_call_arguments.delta", **common, delta=fn["arguments"]))
        item.update(arguments=fn["arguments"], status="completed")
        events.append(self._event("response.function_call_arguments.done", **common, name=fn["name"], arguments=fn["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def finish(self, tallies: Tallies) -> list[dict[str, Any]]:
        """The last events: what the tool stream held, the items closed, then response.completed
        (response.incomplete when max_output_tokens cut the answer)."""
        events: list[dict[str, Any]] = []
        if self._tools is not None:
            content, calls = self._tools.finish()
            events += self._content(content, None) + [e for call in calls for e in self._call(call)]
        if not self.response["output"]:
            events += self._open_message()  # an empty answer is an empty message, not no output
        cut = tallies.of(0).reason == "length"
        events += self._close_message("incomplete" if cut else "completed")
        self.response.update(
            status="incomplete" if cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage=usage(tallies),
        )
        kind = "response.incomplete" if cut else "response.completed"
        return events + [self._event(kind, response=self.snapshot())]

    def fail(self, error: APIError) -> list[dict[str, Any]]:
        """response.failed with the error, after the status was sent."""
        self.response.update(status="failed", error={"code": error.code or error.type, "message": error.message})
        return [self._event("response.failed", response=self.snapshot())]


def not_found(response_id: str, param: str | None = None) -> APIError:
    """404 in OpenAI's words for an unknown (expired, deleted) response id."""
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(404, f"{what} with id {response_id[:80]!r} not found.", param=param, code="response_not_found")
