"""What a generation request sends: the sampling fields, chat messages, the model's inputs on
either protocol (``GenerateRequest``) and the connection options both clients share."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clients.transport import ConnectionOptions, Protocol, tritonclient_module
from contract.sampling import SAMPLING_FIELDS as _FIELDS
from contract.streams import ASK_INPUT, CONTINUATION_INPUTS, PREFIX_INPUT

DEFAULT_MODEL = "text_generation"
# Sampling parameters the served model accepts (vLLM's names), with the JSON types each takes:
# the engine's own table (contract/sampling.py).
SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {f.name: f.kinds for f in _FIELDS}
_ITEMS: dict[str, type] = {f.name: f.items for f in _FIELDS}
ROLES = ("system", "user", "assistant")
PROMPT_IDS_INPUT = "prompt_token_ids"  # INT32 [-1]: the prompt as token ids
_ids = itertools.count(1)


def sampling_parameters(**params: Any) -> dict[str, Any]:
    """The ``sampling_parameters`` JSON object of the given options; ``None`` values are left out.

    Checks names and JSON types only (TypeError/ValueError); ranges are the server's to judge,
    so its INVALID_ARG message (naming the field) reaches the caller unchanged. ``stop`` may be
    one string or a list of strings.
    """
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name not in SAMPLING_FIELDS:
            raise ValueError(f"unknown sampling parameter {name!r}; known: {', '.join(SAMPLING_FIELDS)}")
        if value is None:
            continue
        if list in SAMPLING_FIELDS[name]:
            items = _ITEMS[name]
            value = [value] if isinstance(value, str) and items is str else list(value)
            if not all(isinstance(s, items) and not isinstance(s, bool) for s in value):
                raise TypeError(f"{name} must be a list of {items.__name__}" + (" or one string" if items is str else ""))
        elif isinstance(value, bool) != (SAMPLING_FIELDS[name] == (bool,)) or not isinstance(value, SAMPLING_FIELDS[name]):
            kinds = " or ".join(t.__name__ for t in SAMPLING_FIELDS[name])
            raise TypeError(f"{name} must be {kinds}, not {type(value).__name__}")
        if name == "n" and value != 1:
            # One Generation per request here; n > 1 answers come per choice (the output index):
            # the OpenAI gateway, or Triton directly (docs/generation.md#the-interface).
            raise ValueError(f"n={value}: this client returns one choice per request; ask the OpenAI gateway for n > 1")
        out[name] = value
    return out


def chat_messages(messages: str | Sequence[Mapping[str, str]], system: str | None = None) -> list[dict[str, str]]:
    """A chat as the list of ``{"role", "content"}`` the server renders; a bare string is one
    user message, and ``system`` prepends a system message (replacing one already first)."""
    if isinstance(messages, str):
        items = [{"role": "user", "content": messages}]
    else:
        items = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise TypeError(f"messages[{i}] must be a mapping with string 'role' and 'content'")
            if m["role"] not in ROLES:
                raise ValueError(f"messages[{i}]: role must be one of {', '.join(ROLES)}, not {m['role']!r}")
            items.append({"role": m["role"], "content": m["content"]})
    if not items:
        raise ValueError("no messages")
    if system is not None:
        if items[0]["role"] == "system":
            items = items[1:]
        items.insert(0, {"role": "system", "content": system})
    return items


@dataclass(frozen=True)
class GenerateRequest:
    """One request as the model takes it: prompt (or chat JSON), sampling and flags."""

    text_input: str
    sampling: dict[str, Any] = field(default_factory=dict)
    chat: bool = False
    # A stream continued after its replica died (docs/generation.md#streams-that-outlive-a-replica):
    # the token ids back with each piece, and the answer's first tokens, already received.
    return_token_ids: bool = False
    prefix_token_ids: tuple[int, ...] = ()
    # The prompt as token ids (text_input is then only its text): sent as they are, never re-tokenized.
    prompt_token_ids: tuple[int, ...] = ()

    @classmethod
    def prompt(cls, prompt: str, **sampling: Any) -> GenerateRequest:
        """A completion of ``prompt`` as it is (no chat template)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be str, not {type(prompt).__name__}")
        return cls(prompt, sampling_parameters(**sampling))

    @classmethod
    def from_chat(
        cls, messages: str | Sequence[Mapping[str, str]], system: str | None = None, **sampling: Any
    ) -> GenerateRequest:
        """A chat, sent as JSON messages for the server to render with the model's template."""
        text = json.dumps(chat_messages(messages, system), ensure_ascii=False)
        return cls(text, sampling_parameters(**sampling), chat=True)

    def flags(self, stream: bool) -> dict[str, bool]:
        """The model's BOOL inputs: streaming, no echoed prompt, the finish reason and counts back
        (the cached prompt tokens too)."""
        flags = {
            "stream": stream,
            "exclude_input_in_output": True,
            "return_finish_reason": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
            "return_num_cached_tokens": True,
        }
        if self.chat:
            flags["apply_chat_template"] = True
        if self.return_token_ids:
            flags[ASK_INPUT] = True
        return flags

    def http_body(self, stream: bool) -> bytes:
        """The JSON body of ``/generate`` or ``/generate_stream`` (top-level fields are inputs)."""
        body: dict[str, Any] = {"text_input": self.text_input, **self.flags(stream)}
        if self.sampling:
            body["sampling_parameters"] = json.dumps(self.sampling)
        if self.prompt_token_ids:
            body[PROMPT_IDS_INPUT] = list(self.prompt_token_ids)
        return json.dumps(body, ensure_ascii=False).encode("utf-8")

    def grpc_inputs(self, stream: bool) -> list[Any]:
        """tritonclient.grpc InferInputs (each ``[1]``: the model has no batch dimension)."""
        module = tritonclient_module("grpc")

        def tensor(name: str, value: Any, datatype: str) -> Any:
            array = np.array([value], dtype=object if datatype == "BYTES" else bool)
            t = module.InferInput(name, [1], datatype)
            t.set_data_from_numpy(array)
            return t

        inputs = [tensor("text_input", self.text_input.encode("utf-8"), "BYTES")]
        if self.sampling:
            inputs.append(tensor("sampling_parameters", json.dumps(self.sampling).encode("utf-8"), "BYTES"))
        inputs += [tensor(name, value, "BOOL") for name, value in self.flags(stream).items()]
        if self.prefix_token_ids:
            prefix = module.InferInput(PREFIX_INPUT, [len(self.prefix_token_ids)], CONTINUATION_INPUTS[PREFIX_INPUT])
            prefix.set_data_from_numpy(np.asarray(self.prefix_token_ids, dtype=np.int32))
            inputs.append(prefix)
        if self.prompt_token_ids:
            ids = module.InferInput(PROMPT_IDS_INPUT, [len(self.prompt_token_ids)], "INT32")
            ids.set_data_from_numpy(np.asarray(self.prompt_token_ids, dtype=np.int32))
            inputs.append(ids)
        return inputs


@dataclass(frozen=True)
class GenerationOptions(ConnectionOptions):
    """Validated connection options shared by the sync and asyncio clients
    (clients.transport.ConnectionOptions; ``GenerationOptions.create`` checks them). ``timeout_s``
    is the longest wait for the next response (the first included); ``deadline_s`` bounds the
    attempts before the first response (default ``timeout_s``)."""

    protocol: Protocol = "grpc"
    model: str = DEFAULT_MODEL

    def http_path(self, stream: bool) -> str:
        """The generate extension's path for the model (and version)."""
        version = f"/versions/{self.model_version}" if self.model_version else ""
        return f"/v2/models/{self.model}{version}/{'generate_stream' if stream else 'generate'}"

    def host_port(self, url: str | None = None) -> tuple[str, int]:
        """``url`` (default: the first) split into host and port."""
        url = url or self.url
        host, _, port = url.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"url {url!r} must be host:port")
        return host.strip("[]"), int(port)


def new_request_id() -> str:
    """A request id unique in this process (``gen-<pid>-<n>``), for the server's logs and traces."""
    return f"gen-{os.getpid()}-{next(_ids)}"
