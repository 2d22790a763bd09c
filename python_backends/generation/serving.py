"""What the ``text_generation`` Triton model does per request, without Triton.

The served interface is Triton's vLLM backend's, so clients and tools written for it
work unchanged: ``text_input`` (BYTES), optional ``stream``, ``sampling_parameters`` (a
JSON object), ``exclude_input_in_output``, ``return_finish_reason``,
``return_num_input_tokens``, ``return_num_output_tokens`` (BOOL), and this project's
``apply_chat_template`` (BOOL: ``text_input`` is then a JSON list of chat messages that
the model's own template renders), ``return_num_cached_tokens`` (BOOL: the prompt tokens
the prefix cache held) and ``return_logprobs`` (BOOL: the output ``logprobs``, a JSON list of
OpenAI's token objects, as the sampling parameter ``logprobs`` also asks; alone it means 0
alternatives). A stream continued on another replica after its own died
(docs/generation.md#streams-that-outlive-a-replica) uses two more: ``return_token_ids`` (BOOL:
the output ``token_ids``, the ids whose text each response completes) and ``prefix_token_ids``
(INT32 ``[-1]``: the answer's first tokens, already sent; the model generates what follows them,
``num_output_tokens`` counting them). ``prompt_token_ids`` (INT32 ``[-1]``) is the prompt as token
ids (``text_input`` is then only its text, for an echo), and the output ``prompt_logprobs``
(the sampling parameter ``prompt_logprobs``) a JSON list with one entry per prompt token:
``null`` for the first, OpenAI's token object for each other, with the choice's first response.
Sampling parameters may also come as request
parameters, which is how Triton's ``generate`` / ``generate_stream`` HTTP endpoints pass
``{"parameters": {...}}``.

The shim (``model_repository/text_generation/1/model.py``) reads the tensors into plain
Python values and calls :func:`parse_request`; :class:`ResponseShaper` turns engine
outputs into the output values of each response.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from contract.errors import TOO_LARGE, ConfigError, InputError
from contract.sampling import SAMPLING_FIELDS, SamplingParams
from python_backends.generation.logprobs import TokenLogprob, openai_content, prompt_content
from python_backends.generation.sampling import parse_sampling_params

BOOL_INPUTS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_num_cached_tokens",
    "return_logprobs",
    "return_token_ids",
    "apply_chat_template",
)
# The continued stream's first tokens: at most this many (the model's max_tokens_limit is far below).
MAX_PREFIX_TOKENS = 1 << 16
# Request parameters Triton or its clients set themselves; never sampling parameters.
RESERVED_PARAMETERS = (
    "priority",
    "timeout",
    "sequence_id",
    "sequence_start",
    "sequence_end",
    "headers",
    "binary_data_output",
    "triton_enable_empty_final_response",
)
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str  # what the model continues (the chat template already applied)
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_num_cached_tokens: bool = False
    return_token_ids: bool = False
    prefix_ids: tuple[int, ...] = ()  # the answer's first tokens, sent by a replica that died
    prompt_ids: tuple[int, ...] = ()  # the prompt as token ids (prompt is then its text)


def _scalar_bool(name: str, value: Any) -> bool:
    if value is None:
        return False
    if hasattr(value, "reshape"):  # a numpy array from the tensor
        flat = value.reshape(-1)
        if flat.size != 1:
            raise InputError(name, f"must hold exactly one value, got {flat.size}")
        value = flat[0]
    if isinstance(value, (bool, int)) or type(value).__name__ in ("bool_", "bool"):
        return bool(value)
    raise InputError(name, f"must be a boolean, got {value!r}")


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    """An optional tensor of token ids (their range is the engine's to check)."""
    if value is None:
        return ()
    flat = np.asarray(value).reshape(-1)
    if flat.size > MAX_PREFIX_TOKENS:
        raise InputError(name, f"holds {flat.size} ids; the limit is {MAX_PREFIX_TOKENS}", values={"maximum": MAX_PREFIX_TOKENS})
    if flat.size and flat.dtype.kind not in "iu":
        raise InputError(name, f"must hold integer token ids, got {flat.dtype}")
    return tuple(int(t) for t in flat.tolist())


def _one_bytes(name: str, value: Any, max_bytes: int) -> str:
    if value is None:
        raise InputError(name, "input is missing")
    if hasattr(value, "reshape"):
        flat = value.reshape(-1)
        if flat.size != 1:
            raise InputError(name, f"must hold exactly one string, got {flat.size}")
        value = flat[0]
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, (bytes, bytearray)):
        raise InputError(name, f"must be a string, got {type(value).__name__}")
    if len(value) > max_bytes:
        raise InputError(
            name,
            f"is {len(value)} bytes; the limit is {max_bytes} bytes",
            code=TOO_LARGE,
            values={"maximum": max_bytes, "got": len(value)},
        )
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(name, f"is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


_KINDS = {f.name: f.kinds for f in SAMPLING_FIELDS}


def _coerce_parameter(name: str, value: Any) -> Any:
    """A sampling parameter as the value it stands for.

    HTTP generate keeps JSON types, but Triton's request parameters hold only scalars, so
    a list of stop strings (or a logit_bias object) comes as a JSON string; and tools written for the vLLM backend
    (genai-perf among them) send numbers and booleans as strings, which that backend
    converts. A string that is not a number stays a string and fails validation by name.
    """
    if not isinstance(value, str):
        return value
    text = value.strip()
    kinds = _KINDS.get(name, ())
    if list in kinds and text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(name, f"is not a valid JSON list: {exc}") from None
    if dict in kinds:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(name, f"is not a valid JSON object: {exc}") from None
    number = float if float in kinds else int if int in kinds else None
    if number is not None:
        try:
            return number(text)
        except ValueError:
            return value
    if kinds == (bool,) and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return value


def merge_sampling_sources(sampling_parameters: str | None, request_parameters: Mapping[str, Any] | None) -> dict:
    """The sampling_parameters JSON object, overridden by request parameters of the same names."""
    merged: dict = {}
    if sampling_parameters is not None and sampling_parameters.strip():
        try:
            data = json.loads(sampling_parameters)
        except json.JSONDecodeError as exc:
            raise InputError("sampling_parameters", f"is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InputError("sampling_parameters", f"must be a JSON object, got {type(data).__name__}")
        merged.update({key: _coerce_parameter(key, value) for key, value in data.items()})
    for key, value in (request_parameters or {}).items():
        if key in RESERVED_PARAMETERS or key in BOOL_INPUTS:
            continue
        merged[key] = _coerce_parameter(key, value)
    return merged


def render_chat(tokenizer, text: str, max_messages: int = 256) -> str:
    """The prompt for a JSON list of chat messages, rendered by the model's own template."""
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError("text_input", f"with apply_chat_template, must be a JSON list of messages: {exc}") from None
    if not isinstance(messages, list) or not messages:
        raise InputError("text_input", "with apply_chat_template, must be a non-empty JSON list of messages")
    if len(messages) > max_messages:
        raise InputError("text_input", f"{len(messages)} messages; the limit is {max_messages}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or not isinstance(m.get("content"), str):
            raise InputError("text_input", f"message {i} must be an object with a role and a string content")
        if m.get("role") not in CHAT_ROLES:
            raise InputError("text_input", f"message {i} has role {m.get('role')!r}; expected one of {', '.join(CHAT_ROLES)}")
    if not any(m["content"].strip() for m in messages):
        raise InputError("text_input", "every message is empty")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def parse_request(
    inputs: Mapping[str, Any],
    request_parameters: Mapping[str, Any] | None,
    *,
    tokenizer,
    max_tokens_limit: int,
    default_max_tokens: int,
    max_text_bytes: int,
    sampling_defaults: Mapping[str, Any] | None = None,
) -> GenerationRequest:
    """Validate one request's inputs and parameters; InputError names the field and limit."""
    flags = {name: _scalar_bool(name, inputs.get(name)) for name in BOOL_INPUTS}
    params = dict(request_parameters or {})
    # A boolean input may also come as a request parameter (the generate endpoint's JSON).
    for name in BOOL_INPUTS:
        if inputs.get(name) is None and name in params:
            value = params[name]
            if isinstance(value, str) and value.lower() in ("true", "false"):
                value = value.lower() == "true"
            flags[name] = _scalar_bool(name, value)
    text = _one_bytes("text_input", inputs.get("text_input"), max_text_bytes)
    sampling_raw = inputs.get("sampling_parameters")
    sampling_text = None if sampling_raw is None else _one_bytes("sampling_parameters", sampling_raw, 65536)
    sampling = merge_sampling_sources(sampling_text, params)
    sampling_params = parse_sampling_params(
        sampling, max_tokens_limit=max_tokens_limit, default_max_tokens=default_max_tokens, defaults=sampling_defaults
    )
    if flags["return_logprobs"] and sampling_params.logprobs is None:
        sampling_params = replace(sampling_params, logprobs=0)
    # An empty prompt is the engine's to refuse (LLMEngine.encode), on every path into it.
    return GenerationRequest(
        prompt=render_chat(tokenizer, text) if flags["apply_chat_template"] else text,
        params=sampling_params,
        stream=flags["stream"],
        exclude_input_in_output=flags["exclude_input_in_output"],
        return_finish_reason=flags["return_finish_reason"],
        return_num_input_tokens=flags["return_num_input_tokens"],
        return_num_output_tokens=flags["return_num_output_tokens"],
        return_num_cached_tokens=flags["return_num_cached_tokens"],
        return_token_ids=flags["return_token_ids"],
        prefix_ids=_token_ids("prefix_token_ids", inputs.get("prefix_token_ids")),
        prompt_ids=_token_ids("prompt_token_ids", inputs.get("prompt_token_ids")),
    )


class ResponseShaper:
    """Outputs of each response of one request, from the engine's outputs.

    Streaming: one response per new text piece (the final one may be empty, with the
    finish reason). Not streaming: one response when the request finishes, with the
    prompt in front unless ``exclude_input_in_output`` (the vLLM backend's default).
    With ``n`` > 1 each response is one choice's (the output ``index`` says which, as
    OpenAI's ``choices[].index``); not streaming, one response per choice as it finishes.
    """

    def __init__(self, request: GenerationRequest, token_bytes: Callable[[int], bytes] | None = None):
        self.request = request
        self.token_bytes = token_bytes
        self._parts: dict[int, list[str]] = {}
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self._ids: dict[int, list[int]] = {}  # token ids not sent yet (their text was held back)
        self._prompt: dict[int, list[TokenLogprob | None]] = {}  # prompt entries not sent yet

    def on_output(
        self,
        text: str,
        finished: bool,
        finish_reason: str | None,
        num_input: int,
        num_output: int,
        num_cached: int = 0,
        logprobs: Sequence[TokenLogprob] | None = None,
        index: int = 0,
        token_ids: Sequence[int] = (),
        prompt_logprobs: Sequence[TokenLogprob | None] | None = None,
        structure_fitted: bool = False,
    ):
        """The outputs dict of the response to send now, or None to send nothing yet."""
        r = self.request
        if prompt_logprobs is not None:
            self._prompt[index] = list(prompt_logprobs)
        if logprobs:
            self._logprobs.setdefault(index, []).extend(logprobs)
        if r.return_token_ids and token_ids:
            self._ids.setdefault(index, []).extend(token_ids)
        if not r.stream:
            self._parts.setdefault(index, []).append(text)
            if not finished:
                return None
            body = "".join(self._parts.pop(index))
            text = body if r.exclude_input_in_output else r.prompt + body
        elif not finished and not text:
            return None  # its entries (a special token's) go with the next piece
        out: dict[str, Any] = {"text_output": text}
        if r.params.n > 1:
            out["index"] = index
        if r.params.logprobs is not None and self.token_bytes is not None:
            out["logprobs"] = json.dumps(openai_content(self._logprobs.pop(index, []), self.token_bytes), ensure_ascii=False)
        if index in self._prompt and self.token_bytes is not None:
            out["prompt_logprobs"] = json.dumps(prompt_content(self._prompt.pop(index), self.token_bytes), ensure_ascii=False)
        if r.return_token_ids:
            # Sent with the text they complete: a client that holds the ids holds exactly the
            # tokens behind the text it got, which is what a continuation replays.
            out["token_ids"] = self._ids.pop(index, [])
        if finished or r.stream:
            if r.return_finish_reason:
                out["finish_reason"] = finish_reason if finished else None
            if r.return_num_input_tokens:
                out["num_input_tokens"] = num_input
            if r.return_num_output_tokens:
                out["num_output_tokens"] = num_output
            if r.return_num_cached_tokens:
                out["num_cached_tokens"] = num_cached
            if finished and structure_fitted and r.return_finish_reason:  # only when true: as before otherwise
                out["structure_fitted"] = True
        return out


def engine_settings(param: Any, param_int: Any, param_bool: Any) -> dict:
    """EngineConfig keyword arguments from config.pbtxt parameters (accessors of ModelConfig)."""
    dtype = param("dtype", "float32")
    kv_mb = param_int("kv_cache_mb", 256, minimum=1)
    settings = {
        "dtype": dtype,
        "weights_precision": param("weights_precision", "fp32"),
        "block_size": param_int("block_size", 16, minimum=1),
        "kv_cache_bytes": kv_mb * 2**20,
        "max_num_seqs": param_int("max_num_seqs", 32, minimum=1),
        "max_num_batched_tokens": param_int("max_num_batched_tokens", 512, minimum=1),
        "max_waiting": param_int("max_waiting", 256, minimum=0),
        "max_running_bulk": param_int("max_running_bulk", 0, minimum=0),
        "max_model_len": param_int("max_model_len", 4096, minimum=16),
        "max_tokens_limit": param_int("max_tokens_limit", 2048, minimum=1),
        "default_max_tokens": param_int("default_max_tokens", 16, minimum=1),
        "enable_prefix_caching": param_bool("enable_prefix_caching", True),
        "num_speculative_tokens": param_int("num_speculative_tokens", 0, minimum=0),
        "speculative_max_seqs": param_int("speculative_max_seqs", 2, minimum=0),
        "prefill_tokens_with_decodes": param_int("prefill_tokens_with_decodes", 0, minimum=0),
        "kv_cache_type": param("kv_cache_type", "f16"),
        "flash_attn": param_bool("flash_attn", True),
        "llama_prefix_cells": param_int("llama_prefix_cells", 512, minimum=0),
    }
    for name, default in (("admission_window_ms", 0), ("admission_quiet_ms", 15)):
        value = param_int(name, default, minimum=0)
        if value > 1000:
            raise ConfigError(f"{name} must be <= 1000 ms, got {value}")
        settings[name] = value
    threads = param_int("num_threads", 0, minimum=0)
    if threads:
        settings["num_threads"] = threads
    if settings["default_max_tokens"] > settings["max_tokens_limit"]:
        raise ConfigError(
            f"default_max_tokens ({settings['default_max_tokens']}) must be <= max_tokens_limit ({settings['max_tokens_limit']})"
        )
    if settings["max_num_batched_tokens"] < settings["max_num_seqs"]:
        raise ConfigError(
            f"max_num_batched_tokens ({settings['max_num_batched_tokens']}) must be >= max_num_seqs "
            f"({settings['max_num_seqs']}): every running stream gets a token each step"
        )
    return settings
