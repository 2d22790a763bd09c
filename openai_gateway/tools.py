"""Tool calling for a model whose chat template has no tools: a documented fallback prompt, the
calls enforced by the engine's JSON guide when the client requires them, and the answer parsed
back into OpenAI's ``tool_calls``.

The prompt. A system message lists the functions (name, description, parameters schema) and
asks for calls as one JSON list, ``[{"name": ..., "arguments": {...}}]``. An assistant message
that made calls is shown to the model in that same form, and a ``tool`` message as a user
message ``Result of <name> (<tool_call_id>): <content>``, so a conversation round-trips.

``tool_choice``: ``none`` (the default without tools) sends no tools; ``auto`` (the default
with tools) lets the model choose, and an answer that is such a list of known functions becomes
``tool_calls``; ``required`` and a named function are enforced: the list's JSON schema (each
item's ``name`` a constant, its ``arguments`` the function's parameters; one item when
``parallel_tool_calls`` is false or a function is named, else at most ``MAX_PARALLEL_CALLS``)
becomes the engine's ``guided_json``.
Objects in the parameters that do not say ``additionalProperties`` are closed there (no keys
beyond those listed), as OpenAI's strict function calling has them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from openai_gateway.errors import bad_request

MAX_TOOLS = 128  # OpenAI's limit
MAX_PARALLEL_CALLS = 4  # calls in one enforced answer (tool_choice required with parallel_tool_calls)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
INSTRUCTION = (
    "You can call these functions. To call one or more, answer with only a JSON list of calls, "
    '[{"name": "<function name>", "arguments": {<arguments as the parameters schema says>}}], and nothing else.'
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolUse:
    """A request's tools as the answer needs them: which may be called, and whether enforced."""

    tools: tuple[Tool, ...]
    choice: str  # auto, required or the named function
    parallel: bool

    @property
    def enforced(self) -> bool:
        return self.choice != "auto"

    def schema(self) -> dict:
        """The JSON schema of the calls the engine enforces (required or named)."""
        allowed = [t for t in self.tools if self.choice in ("required", t.name)]
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": closed(t.parameters)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in allowed
        ]
        array: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        # One call, or at most MAX_PARALLEL_CALLS: a small model repeats calls until max_tokens cuts
        # the list (then no call parses at all), as it would add keys to an open object.
        array["maxItems"] = MAX_PARALLEL_CALLS if self.parallel and self.choice == "required" else 1
        return array

    def system_prompt(self) -> str:
        listed = [
            json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}, ensure_ascii=False)
            for t in self.tools
            if self.choice in ("auto", "required", t.name)
        ]
        return INSTRUCTION + "\n" + "\n".join(listed)

    def calls(self, text: str) -> list[dict] | None:
        """OpenAI's ``tool_calls`` of an answer that is a JSON list of calls of known functions
        (a single call object too), else None (the answer is content)."""
        try:
            value = json.loads(text.strip())
        except json.JSONDecodeError:
            return None
        value = [value] if isinstance(value, dict) else value
        if not isinstance(value, list) or not value:
            return None
        out = [self.call(item) for item in value]
        return None if any(c is None for c in out) else [c for c in out if c is not None]

    def call(self, value: Any) -> dict | None:
        """OpenAI's tool call object of one parsed call of a known function, else None."""
        names = {t.name for t in self.tools}
        if not (isinstance(value, dict) and value.get("name") in names and isinstance(value.get("arguments", {}), dict)):
            return None
        arguments = json.dumps(value.get("arguments", {}), ensure_ascii=False)
        return {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": value["name"], "arguments": arguments},
        }


class ToolStream:
    """One streamed choice of an answer that may be calls: content is passed on as it comes once
    the answer's first character says it is not a JSON list or object; calls are passed on one by
    one, each as soon as its JSON object is complete. ``feed`` and ``finish`` return (content to
    send, calls to send)."""

    def __init__(self, tools: ToolUse):
        self.tools = tools
        self._text = ""
        self._mode: str | None = None  # None: undecided; "content"; "calls"; "held": not calls as it goes
        self._pos = 0  # calls: where the next call (or the list's end) starts
        self._list = False
        self.sent = 0  # calls sent

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        if self._mode == "content":
            return piece, []
        self._text += piece
        if self._mode is None:
            stripped = self._text.lstrip()
            if not stripped:
                return "", []
            if stripped[0] not in "[{":
                self._mode = "content"
                return self._text, []
            self._mode, self._list = "calls", stripped[0] == "["
            self._pos = len(self._text) - len(stripped) + (1 if self._list else 0)
        return "", self._complete_calls() if self._mode == "calls" else []

    def _complete_calls(self) -> list[dict]:
        out: list[dict] = []
        decoder = json.JSONDecoder()
        while True:
            rest = self._text[self._pos :]
            skipped = len(rest) - len(rest.lstrip(" \t\r\n,"))
            start = self._pos + skipped
            if start >= len(self._text) or self._text[start] in "]":
                return out
            try:
                value, end = decoder.raw_decode(self._text, start)
            except json.JSONDecodeError:
                return out  # not complete yet (or not JSON: finish decides)
            call = self.tools.call(value)
            if call is None:
                self._mode = "held"
                return out
            out.append(call)
            self.sent += 1
            self._pos = end
            if not self._list:
                self._mode = "held"  # one call object: anything after it is judged at the end
                return out

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end: nothing after calls already sent (the list's end); else the
        whole answer as calls if it is a list of calls, or as content."""
        if self._mode == "content":
            return "", []
        if self.sent:
            return "", []
        calls = self.tools.calls(self._text)
        if not calls:
            return self._text, []
        self.sent = len(calls)
        return "", calls


def closed(schema: Any) -> Any:
    """A copy of ``schema`` whose objects take no properties beyond those listed, unless they
    say otherwise, as OpenAI's strict function calling has them: an open object lets a small
    model add keys until max_tokens cuts the call."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in schema[key].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "additionalProperties")


def check_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolUse | None:
    """The request's tools as a ToolUse (None: no tools are offered); 400 naming the part that is wrong."""
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise bad_request("tool_choice must be none, auto, required or a named function", param="tool_choice")
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools has {len(tools)} items; the limit is {MAX_TOOLS}", param="tools")
    parsed: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, _ or -", param=f"{where}.function.name")
        if any(t.name == name for t in parsed):
            raise bad_request(f"{where}.function.name {name!r} is given twice", param=f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object", param=f"{where}.function.parameters")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise bad_request(f"{where}.function.description must be a string", param=f"{where}.function.description")
        parsed.append(Tool(name, description, params))
    if tool_choice in (None, "auto"):
        choice = "auto"
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        choice = "required"
    else:
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or name is None:
            raise bad_request("tool_choice must be none, auto, required or a named function", param="tool_choice")
        if not any(t.name == name for t in parsed):
            raise bad_request(f"tool_choice names {str(name)[:64]!r}, which is not in tools", param="tool_choice")
        choice = name
    return ToolUse(tuple(parsed), choice, parallel is not False)


def render_message(message: Any, index: int, names: dict[str, str]) -> dict[str, str] | None:
    """A message of the tool round trip as the model sees it (None: not one of those): an
    assistant's calls as the JSON list, a tool result as a user message. ``names``: call id ->
    function name of the calls seen so far (filled here)."""
    if message.role == "assistant" and message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            where = f"messages[{index}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"{where} must have a function with a name", param=where)
            try:
                arguments = json.loads(fn.get("arguments") or "{}")
            except (TypeError, json.JSONDecodeError):
                raise bad_request(
                    f"{where}.function.arguments must be a JSON string", param=f"{where}.function.arguments"
                ) from None
            if isinstance(call.get("id"), str):
                names[call["id"]] = fn["name"]
            calls.append({"name": fn["name"], "arguments": arguments})
        return {"role": "assistant", "content": json.dumps(calls, ensure_ascii=False)}
    if message.role == "tool":
        if not isinstance(message.tool_call_id, str):
            raise bad_request(f"messages[{index}].tool_call_id is missing", param=f"messages[{index}].tool_call_id")
        content = message.content if isinstance(message.content, str) else ""
        name = names.get(message.tool_call_id, "the function")
        return {"role": "user", "content": f"Result of {name} ({message.tool_call_id}): {content}"}
    return None
