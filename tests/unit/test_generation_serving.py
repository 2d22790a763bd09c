"""text_generation's request parsing and response shaping, without Triton (the real tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from contract.errors import ConfigError, InputError
from python_backends.generation.serving import ResponseShaper, engine_settings, parse_request

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "text_generation" / "1"


@pytest.fixture(scope="module")
def tokenizer():
    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("text_generation not exported (python -m export.generation)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def req(tokenizer, text=b"Hello", params=None, **inputs):
    values = {"text_input": np.array([text], dtype=object)}
    for name, value in inputs.items():
        values[name] = (
            value
            if isinstance(value, np.ndarray)
            else np.array([value], dtype=object if isinstance(value, (bytes, str)) else bool)
        )
    return parse_request(values, params, tokenizer=tokenizer, max_tokens_limit=2048, default_max_tokens=16, max_text_bytes=1000)


def test_defaults_and_both_parameter_sources(tokenizer):
    r = req(tokenizer)
    assert r.prompt == "Hello" and r.params.max_tokens == 16 and not r.stream
    r = req(
        tokenizer,
        sampling_parameters=json.dumps({"max_tokens": 5, "temperature": 0.5}),
        params={"temperature": 0, "stop": '["a", "b"]', "priority": 1},
        stream=True,
    )
    assert r.params.max_tokens == 5 and r.params.temperature == 0.0 and r.params.stop == ("a", "b")
    assert r.stream
    # The generate endpoint's JSON may carry the boolean inputs as parameters.
    assert req(tokenizer, params={"stream": True, "exclude_input_in_output": "true"}).exclude_input_in_output


def test_numbers_and_booleans_as_strings_are_converted_as_the_vllm_backend_does(tokenizer):
    r = req(
        tokenizer,
        sampling_parameters=json.dumps({"max_tokens": "8", "temperature": "0.5", "ignore_eos": "true"}),
        params={"top_k": "5", "seed": "7"},
    )
    assert (r.params.max_tokens, r.params.temperature, r.params.ignore_eos, r.params.top_k, r.params.seed) == (8, 0.5, True, 5, 7)
    with pytest.raises(InputError, match="max_tokens: must be an integer, got str 'eight'"):
        req(tokenizer, params={"max_tokens": "eight"})
    with pytest.raises(InputError, match="max_tokens: must be an integer"):
        req(tokenizer, params={"max_tokens": "8.5"})


def test_chat_template_renders_messages(tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = req(tokenizer, json.dumps(msgs).encode(), apply_chat_template=True)
    assert r.prompt.endswith("<|im_start|>assistant\n") and "Be brief." in r.prompt


@pytest.mark.parametrize(
    "text, params, inputs, field, words",
    [
        (b"\xff\xfe", None, {}, "text_input", "UTF-8"),
        (b"x" * 1001, None, {}, "text_input", "limit is 1000 bytes"),
        (b"hi", None, {"sampling_parameters": b"{not json"}, "sampling_parameters", "JSON"),
        (b"hi", None, {"sampling_parameters": b"[1]"}, "sampling_parameters", "JSON object"),
        (b"hi", {"bogus": 1}, {}, "bogus", "unknown sampling parameter"),
        (b"hi", {"max_tokens": 0}, {}, "max_tokens", "> 0"),
        (b"hi", {"max_tokens": 5000}, {}, "max_tokens", "<= 2048"),
        (b"hi", {"temperature": -1}, {}, "temperature", ">= 0"),
        (b"hi", {"top_p": 0}, {}, "top_p", "(0, 1]"),
        (b"hi", {"top_p": 1.5}, {}, "top_p", "(0, 1]"),
        (b"hi", {"top_k": -1}, {}, "top_k", "between 0 (0 disables it) and"),
        (b"hi", {"stop": json.dumps(["s"] * 17)}, {}, "stop", "at most 16"),
        (b"hi", {"stop": "[broken"}, {}, "stop", "JSON list"),
        (b"hi", None, {"stream": np.array([1, 2], dtype=bool)}, "stream", "exactly one"),
        (b"not json", None, {"apply_chat_template": True}, "text_input", "JSON list of messages"),
        (b'[{"role": "robot", "content": "x"}]', None, {"apply_chat_template": True}, "text_input", "role"),
        (b"[]", None, {"apply_chat_template": True}, "text_input", "non-empty"),
    ],
)
def test_bad_requests_name_the_field(tokenizer, text, params, inputs, field, words):
    with pytest.raises(InputError) as info:
        req(tokenizer, text, params, **inputs)
    assert info.value.field == field
    assert words in str(info.value)


def test_response_shaper_streaming_and_whole():
    from python_backends.generation.sampling import SamplingParams
    from python_backends.generation.serving import GenerationRequest

    base = dict(prompt="P:", params=SamplingParams())
    s = ResponseShaper(GenerationRequest(**base, stream=True, return_finish_reason=True, return_num_output_tokens=True))
    assert s.on_output("a", False, None, 3, 1) == {"text_output": "a", "finish_reason": None, "num_output_tokens": 1}
    assert s.on_output("", False, None, 3, 2) is None  # nothing new to say
    assert s.on_output("", True, "stop", 3, 2) == {"text_output": "", "finish_reason": "stop", "num_output_tokens": 2}
    w = ResponseShaper(GenerationRequest(**base))
    assert w.on_output("a", False, None, 3, 1) is None
    assert w.on_output("b", True, "length", 3, 2) == {"text_output": "P:ab"}
    x = ResponseShaper(GenerationRequest(**base, exclude_input_in_output=True, return_num_input_tokens=True))
    x.on_output("a", False, None, 3, 1)
    assert x.on_output("b", True, "length", 3, 2) == {"text_output": "ab", "num_input_tokens": 3}
    c = ResponseShaper(GenerationRequest(**base, exclude_input_in_output=True, return_num_cached_tokens=True))
    assert c.on_output("a", True, "stop", 40, 1, 32) == {"text_output": "a", "num_cached_tokens": 32}


def test_response_shaper_with_n_choices_says_each_responses_choice():
    from python_backends.generation.sampling import SamplingParams
    from python_backends.generation.serving import GenerationRequest

    base = dict(prompt="P:", params=SamplingParams(n=2), exclude_input_in_output=True, return_finish_reason=True)
    whole = ResponseShaper(GenerationRequest(**base))
    assert whole.on_output("a", False, None, 3, 1, index=0) is None
    assert whole.on_output("x", False, None, 3, 1, index=1) is None
    # Each choice's whole text in its own response when it finishes, the choices' texts kept apart.
    assert whole.on_output("y", True, "stop", 3, 2, index=1) == {"text_output": "xy", "index": 1, "finish_reason": "stop"}
    assert whole.on_output("b", True, "length", 3, 2, index=0) == {"text_output": "ab", "index": 0, "finish_reason": "length"}
    stream = ResponseShaper(GenerationRequest(**base, stream=True))
    assert stream.on_output("a", False, None, 3, 1, index=1) == {"text_output": "a", "index": 1, "finish_reason": None}
    one = ResponseShaper(GenerationRequest(prompt="P:", params=SamplingParams(), stream=True))
    assert "index" not in one.on_output("a", False, None, 3, 1)  # n = 1: the vLLM backend's responses, unchanged


def test_logprobs_are_asked_by_the_sampling_field_or_the_flag_and_sent_as_openai_objects(tokenizer):
    from python_backends.generation.logprobs import TokenBytes, TokenLogprob

    assert req(tokenizer).params.logprobs is None
    assert req(tokenizer, return_logprobs=True).params.logprobs == 0  # the flag alone: no alternatives
    assert req(tokenizer, sampling_parameters=json.dumps({"logprobs": 3}), return_logprobs=True).params.logprobs == 3
    assert req(tokenizer, params={"logprobs": "2"}).params.logprobs == 2  # a request parameter, as a string
    with pytest.raises(InputError, match="logprobs: must be between 0 and 20, got 21"):
        req(tokenizer, params={"logprobs": 21})
    token_bytes = TokenBytes(tokenizer)
    hi, there = tokenizer.encode("Hi there", add_special_tokens=False)
    stream = ResponseShaper(req(tokenizer, params={"logprobs": 1}, stream=True), token_bytes)
    first = stream.on_output("Hi", False, None, 3, 1, 0, [TokenLogprob(hi, -0.25, ((hi, -0.25),))])
    assert json.loads(first["logprobs"]) == [
        {
            "token": "Hi",
            "logprob": -0.25,
            "bytes": [72, 105],
            "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]}],
        }
    ]
    eos = tokenizer.eos_token_id
    assert stream.on_output("", False, None, 3, 2, 0, [TokenLogprob(eos, -1.0)]) is None  # no text: kept for the next piece
    last = json.loads(stream.on_output(" there", True, "stop", 3, 3, 0, [TokenLogprob(there, -0.5)])["logprobs"])
    assert [(e["token"], e["logprob"]) for e in last] == [("", -1.0), (" there", -0.5)]  # a special token is no text
    whole = ResponseShaper(req(tokenizer, return_logprobs=True), token_bytes)
    assert whole.on_output("Hi", False, None, 3, 1, 0, [TokenLogprob(hi, -0.25)]) is None
    out = whole.on_output(" there", True, "length", 3, 2, 0, [TokenLogprob(there, -0.5)])
    assert [e["token"] for e in json.loads(out["logprobs"])] == ["Hi", " there"]
    assert "logprobs" not in ResponseShaper(req(tokenizer), token_bytes).on_output("a", True, "stop", 1, 1)


def test_engine_settings_from_parameters():
    values = {"max_num_seqs": 64, "max_num_batched_tokens": 32}

    def param(key, default=None):
        return default

    def param_int(key, default, minimum=None):
        return values.get(key, default)

    with pytest.raises(ConfigError, match="max_num_batched_tokens \\(32\\) must be >= max_num_seqs \\(64\\)"):
        engine_settings(param, param_int, lambda k, d: d)
    values["max_num_batched_tokens"] = 256
    s = engine_settings(param, param_int, lambda k, d: d)
    assert s["kv_cache_bytes"] == 256 * 2**20 and s["max_num_seqs"] == 64
    assert s["prefill_tokens_with_decodes"] == 0  # the whole step budget
    values["prefill_tokens_with_decodes"] = 64
    assert engine_settings(param, param_int, lambda k, d: d)["prefill_tokens_with_decodes"] == 64


def test_token_ids_travel_with_the_text_they_complete_and_a_prefix_is_read_as_ids(tokenizer):
    from python_backends.generation.sampling import SamplingParams
    from python_backends.generation.serving import GenerationRequest

    s = ResponseShaper(GenerationRequest(prompt="P:", params=SamplingParams(), stream=True, return_token_ids=True))
    assert s.on_output("a", False, None, 3, 1, token_ids=[7]) == {"text_output": "a", "token_ids": [7]}
    assert s.on_output("", False, None, 3, 2, token_ids=[8]) is None  # its text held back: its id waits too
    assert s.on_output("bc", False, None, 3, 3, token_ids=[9]) == {"text_output": "bc", "token_ids": [8, 9]}
    assert "token_ids" not in ResponseShaper(GenerationRequest(prompt="P:", params=SamplingParams(), stream=True)).on_output(
        "a", False, None, 3, 1, token_ids=[7]
    )
    r = req(tokenizer, prefix_token_ids=np.array([5, 6], dtype=np.int32), return_token_ids=True)
    assert (r.prefix_ids, r.return_token_ids) == ((5, 6), True)
    assert req(tokenizer).prefix_ids == ()
    with pytest.raises(InputError) as e:
        req(tokenizer, prefix_token_ids=np.array([0.5], dtype=np.float32))
    assert e.value.field == "prefix_token_ids"
