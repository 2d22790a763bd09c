"""``/v1/chat/completions`` and ``/v1/completions`` without a server: request checks and their
mapping to the generation model's sampling parameters, the SSE chunks, the whole bodies
(openai_gateway/completions.py), and Triton errors mapped to HTTP statuses (triton.py)."""

import dataclasses
import math
from pathlib import Path

import orjson
import pytest
from tritonclient.utils import InferenceServerException

from openai_gateway.catalog import Catalog
from openai_gateway.completions import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChunkWriter,
    Tallies,
    Tally,
    check_chat,
    check_completion,
    whole_body,
)
from openai_gateway.errors import APIError
from openai_gateway.schemas import ChatCompletionRequest, CompletionRequest
from openai_gateway.settings import GatewaySettings
from openai_gateway.triton import triton_error

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = GatewaySettings()
USER = [{"role": "user", "content": "Hello"}]


def one(tally: Tally) -> Tallies:
    """The tallies of a one-choice answer."""
    tallies = Tallies()
    tallies.by_index[0] = tally
    return tallies


@pytest.fixture(scope="module")
def model():
    return Catalog.from_repository(ROOT / "model_repository").models["text_generation"]


def chat(model, settings=SETTINGS, **fields):
    fields.setdefault("messages", USER)
    return check_chat(ChatCompletionRequest(model="text_generation", **fields), model, settings)


def completion(model, settings=SETTINGS, **fields):
    fields.setdefault("prompt", "Once upon a time")
    return check_completion(CompletionRequest(model="text_generation", **fields), model, settings)


def refused(fn, model, settings=SETTINGS, **fields) -> APIError:
    with pytest.raises(APIError) as err:
        fn(model, settings, **fields)
    return err.value


# --- max_tokens ----------------------------------------------------------------------------


def test_without_max_tokens_the_engine_fills_the_context_up_to_the_default(model):
    # null: the model's max_tokens_limit, lowered to the room the prompt leaves (the engine's option).
    assert chat(model).sampling == {"max_tokens": None, "fit_to_context": True}
    assert chat(model, dataclasses.replace(SETTINGS, default_max_tokens=100)).sampling == {
        "max_tokens": 100,
        "fit_to_context": True,
    }
    # A cap also bounds the default.
    assert chat(model, dataclasses.replace(SETTINGS, max_tokens_cap=50)).sampling["max_tokens"] == 50
    assert chat(model, dataclasses.replace(SETTINGS, default_max_tokens=100, max_tokens_cap=50)).sampling["max_tokens"] == 50


def test_completions_default_max_tokens_is_16_or_the_setting(model):
    assert COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    assert completion(model).sampling == {"max_tokens": 16, "fit_to_context": True}
    assert completion(model, dataclasses.replace(SETTINGS, default_max_tokens=100)).sampling["max_tokens"] == 100
    # A max_tokens the client chose is kept as it is: the engine refuses it if it does not fit.
    assert completion(model, max_tokens=16).sampling == {"max_tokens": 16}


def test_max_completion_tokens_wins_over_max_tokens(model):
    assert chat(model, max_tokens=7).sampling["max_tokens"] == 7
    assert chat(model, max_completion_tokens=9).sampling["max_tokens"] == 9
    assert chat(model, max_tokens=7, max_completion_tokens=9).sampling["max_tokens"] == 9
    # The engine's errors name max_tokens: the request's own field is what comes back.
    assert chat(model, max_completion_tokens=9).fields["max_tokens"] == "max_completion_tokens"
    assert chat(model, max_tokens=9).fields["max_tokens"] == "max_tokens"


def test_max_tokens_cap_is_the_gateways_own_policy(model):
    settings = dataclasses.replace(SETTINGS, max_tokens_cap=100)
    assert chat(model, settings, max_tokens=100).sampling["max_tokens"] == 100
    err = refused(chat, model, settings, max_tokens=101)
    assert (err.status, err.param) == (400, "max_tokens") and "<= 100" in err.message
    err = refused(chat, model, settings, max_completion_tokens=101)
    assert (err.status, err.param) == (400, "max_completion_tokens")
    err = refused(completion, model, settings, max_tokens=101)
    assert (err.status, err.param) == (400, "max_tokens")
    # The model's own max_tokens_limit (and > 0) is the engine's to judge: passed on as it is
    # (tests/integration/test_openai_gateway.py checks its refusal through Triton).
    assert chat(model, max_tokens=2049).sampling["max_tokens"] == 2049


# --- sampling mapping ----------------------------------------------------------------------


def test_sampling_fields_are_passed_to_the_engine(model):
    job = chat(
        model,
        max_tokens=20,
        temperature=0,
        top_p=0.9,
        seed=42,
        stop="\n\n",
        top_k=5,
        min_tokens=2,
        repetition_penalty=1.1,
        ignore_eos=True,
        presence_penalty=0,
        frequency_penalty=0.0,
        n=3,
    )
    assert job.n == 3
    assert job.sampling == {
        "n": 3,
        "max_tokens": 20,
        "temperature": 0.0,
        "top_p": 0.9,
        "seed": 42,
        "stop": ["\n\n"],
        "top_k": 5,
        "min_tokens": 2,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
    }
    assert isinstance(job.sampling["temperature"], float)
    # OpenAI's penalties, min_p and logit_bias go to the engine as they are (it judges them).
    more = chat(model, presence_penalty=0.5, frequency_penalty=-1, min_p=0.05, logit_bias={"50256": -100})
    assert {k: more.sampling[k] for k in ("presence_penalty", "frequency_penalty", "min_p", "logit_bias")} == {
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "min_p": 0.05,
        "logit_bias": {"50256": -100},
    }
    assert chat(model, stop=["a", "b"]).sampling["stop"] == ["a", "b"]
    assert "stop" not in chat(model, stop=[]).sampling
    assert chat(model, temperature=2, top_p=1, seed=2**63 - 1).sampling["seed"] == 2**63 - 1


@pytest.mark.parametrize(
    "fields, param",
    [
        # OpenAI's own policy; the engine judges the other values (the integration test).
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
    ],
)
@pytest.mark.parametrize("fn", [chat, completion], ids=["chat", "completion"])
def test_sampling_refusals_name_the_field(model, fn, fields, param):
    err = refused(fn, model, **fields)
    assert (err.status, err.param) == (400, param), err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


# --- chat refusals -------------------------------------------------------------------------


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tools_are_listed_in_a_system_message_and_required_calls_are_the_engines_guide(model):
    job = chat(model, tools=[TOOL, CLOCK])  # auto: listed, not enforced
    first = orjson.loads(job.text_input)[0]
    assert first["role"] == "system" and "get_weather" in first["content"] and "JSON list of calls" in first["content"]
    assert "guided_json" not in job.sampling and job.tools.choice == "auto"
    required = chat(model, tools=[TOOL, CLOCK], tool_choice="required")
    schema = required.sampling["guided_json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 4  # parallel calls allowed, bounded
    assert [i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert required.fields["guided_json"] == "tools"
    weather = schema["items"]["anyOf"][0]["properties"]["arguments"]
    assert weather["additionalProperties"] is False and TOOL["function"]["parameters"].get("additionalProperties") is None
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object", "properties": {}}}}}
    from openai_gateway.tools import closed

    assert closed(nested)["properties"]["a"]["items"]["additionalProperties"] is False
    assert closed({"type": "object", "additionalProperties": True}) == {"type": "object", "additionalProperties": True}
    named = chat(model, tools=[TOOL, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.sampling["guided_json"]["items"]["properties"]["name"] == {"const": "get_time"}
    assert named.sampling["guided_json"]["maxItems"] == 1
    one = chat(model, tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    assert one.sampling["guided_json"]["maxItems"] == 1
    none = chat(model, tools=[TOOL], tool_choice="none")
    assert none.tools is None and orjson.loads(none.text_input)[0]["role"] == "user"


def test_tool_calls_come_back_in_openais_shape_whole_and_streamed(model):
    job = chat(model, tools=[TOOL, CLOCK], tool_choice="required")
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    body = orjson.loads(whole_body(job, {0: text}, one(Tally("stop", 50, 20))))
    message, reason = body["choices"][0]["message"], body["choices"][0]["finish_reason"]
    assert reason == "tool_calls" and message["content"] is None
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"], orjson.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Oslo"}),
        ("function", "get_time", {}),
    ]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    # auto: an answer that is not a list of known calls is content.
    auto = chat(model, tools=[TOOL])
    plain = orjson.loads(whole_body(auto, {0: "It is sunny."}, one(Tally("stop", 5, 3))))["choices"][0]
    assert plain["message"]["content"] == "It is sunny." and plain["finish_reason"] == "stop"
    unknown = orjson.loads(whole_body(auto, {0: '[{"name": "rm", "arguments": {}}]'}, one(Tally("stop", 5, 3))))["choices"][0]
    assert "tool_calls" not in unknown["message"]


def _events(data: bytes) -> list[dict]:
    return [orjson.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]


def test_streamed_tools_send_content_as_it_comes_and_each_call_once_complete(model):
    """With tools, a streamed answer is not held to its end: content goes out from its first
    character that cannot start a call, and each call as a tool_calls delta once its object closes."""
    writer = ChunkWriter(chat(model, tools=[TOOL, CLOCK], tool_choice="required", stream=True))
    assert writer.text('[{"name": "get_weather", ') == b""  # the first call is not complete yet
    first = _events(writer.text('"arguments": {"city": "Oslo"}}, {"name": "get_'))
    delta = first[0]["choices"][0]["delta"]["tool_calls"]
    assert [(d["index"], d["function"]) for d in delta] == [(0, {"name": "get_weather", "arguments": '{"city": "Oslo"}'})]
    second = _events(writer.text('time", "arguments": {}}]'))
    assert [(d["index"], d["function"]["name"]) for d in second[0]["choices"][0]["delta"]["tool_calls"]] == [(1, "get_time")]
    assert delta[0]["id"] != second[0]["choices"][0]["delta"]["tool_calls"][0]["id"]
    end = _events(writer.finish(one(Tally("stop", 5, 3))))
    assert [e["choices"][0]["finish_reason"] for e in end] == ["tool_calls"]  # nothing sent twice
    # auto, and the answer is prose: each piece goes out as it comes.
    writer = ChunkWriter(chat(model, tools=[TOOL], stream=True))
    assert writer.text("  ") == b""  # whitespace decides nothing
    assert _events(writer.text("It is"))[0]["choices"][0]["delta"]["content"] == "  It is"
    assert _events(writer.text(" sunny."))[0]["choices"][0]["delta"]["content"] == " sunny."
    assert [e["choices"][0]["finish_reason"] for e in _events(writer.finish(one(Tally("stop", 5, 3))))] == ["stop"]
    # auto, and a list that turns out not to be calls: content, at the end.
    writer = ChunkWriter(chat(model, tools=[TOOL], stream=True))
    assert writer.text("[1, 2") == b"" and writer.text("]") == b""
    end = _events(writer.finish(one(Tally("stop", 5, 3))))
    assert end[0]["choices"][0]["delta"]["content"] == "[1, 2]" and end[-1]["choices"][0]["finish_reason"] == "stop"
    # one call object, not in a list
    writer = ChunkWriter(chat(model, tools=[TOOL], stream=True))
    call = _events(writer.text('{"name": "get_weather", "arguments": {"city": "Rome"}}'))
    assert call[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert _events(writer.finish(one(Tally("stop", 5, 3))))[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_tool_round_trip_is_rendered_for_the_model(model):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"},
    ]
    job = chat(model, messages=messages, tools=[TOOL])
    rendered = orjson.loads(job.text_input)
    assert rendered[2] == {"role": "assistant", "content": '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'}
    assert rendered[3] == {"role": "user", "content": "Result of get_weather (call_1): 12 C, rain"}


@pytest.mark.parametrize(
    "fields, status, param",
    [
        ({"top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, 400, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, 400, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, 400, "tools[0].function.parameters"),
        ({"tools": [TOOL, TOOL]}, 400, "tools[1].function.name"),
        ({"tools": [TOOL] * 129}, 400, "tools"),
        ({"tool_choice": "auto"}, 400, "tool_choice"),  # without tools
        ({"tools": [TOOL], "tool_choice": "sometimes"}, 400, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, 400, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"functions": [{"name": "f"}]}, 400, "functions"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "x\ud800"}}]}, 400, "tools"),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}]},
            400,
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"response_format": {"type": "xml"}}, 400, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": 5}}, 400, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, 400, "response_format.json_schema.schema"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}, 400, "messages[1].role"),
        ({"messages": [{"role": "User", "content": "a"}]}, 400, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}],
                    }
                ]
            },
            400,
            "messages[0].content[1].type",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "x"}] * 257}, 413, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 40_000}] * 2}, 413, "messages"),
    ],
)
def test_chat_refusals(model, fields, status, param):
    err = refused(chat, model, **fields)
    assert (err.status, err.param) == (status, param), err.message


@pytest.mark.parametrize(
    "fn, fields, param",
    [
        (chat, {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "x\udc00"}]}, "messages[1].content"),
        (chat, {"stop": ["ok", "\ud800"]}, "stop[1]"),
        (completion, {"prompt": "Once \ud83d upon"}, "prompt"),
        (completion, {"stop": "\ud800"}, "stop[0]"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(model, fn, fields, param):
    err = refused(fn, model, **fields)
    assert (err.status, err.param) == (400, param) and "not valid Unicode" in err.message


def test_chat_accepts_what_it_can_honour(model):
    """Each field as asked is what the model does anyway: no tools, plain text, no log-probabilities."""
    job = chat(model, tool_choice="none", response_format={"type": "text"}, logprobs=False, tools=[])
    assert job.tools is None and not job.logprobs and "logprobs" not in job.sampling
    assert not any(k.startswith("guided_") for k in job.sampling), job.sampling


def test_chat_messages_become_the_templates_json(model):
    job = chat(
        model,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Again", "name": "ann"},
        ],
    )
    assert job.chat and not job.stream and not job.include_usage
    assert orjson.loads(job.text_input) == [
        {"role": "system", "content": "Be brief."},  # developer is the system role for this template
        {"role": "user", "content": "Hello, world"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again"},
    ]
    assert job.completion_id.startswith("chatcmpl-")


def test_stream_flags(model):
    assert chat(model, stream=True).stream and not chat(model, stream=True).include_usage
    job = chat(model, stream=True, stream_options={"include_usage": True})
    assert job.stream and job.include_usage
    assert not chat(model, stream=True, stream_options={"include_usage": False}).include_usage


# --- completion refusals -------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, status, param",
    [
        ({"best_of": 2}, 400, "best_of"),
        ({"n": 2, "best_of": 3}, 400, "best_of"),
        ({"logprobs": 6}, 400, "logprobs"),
        ({"logprobs": -1}, 400, "logprobs"),
        ({"suffix": "end"}, 400, "suffix"),
        ({"prompt": ["one", "two"], "stream": True}, 400, "stream"),
        ({"prompt": [1, 2, 3]}, 400, "prompt"),
        ({"prompt": [[1, 2]]}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": "x" * 65537}, 413, "prompt"),
    ],
)
def test_completion_refusals(model, fields, status, param):
    err = refused(completion, model, **fields)
    assert (err.status, err.param) == (status, param), err.message


class _Vocab:
    """The ModelTokenizer's part that token prompts use."""

    vocab_size = 100

    class tokenizer:  # noqa: N801 - tokenizers.Tokenizer's decode
        @staticmethod
        def decode(ids, skip_special_tokens=False):
            return "".join(f"<{i}>" for i in ids)


def test_completion_prompt_forms_and_echo(model):
    assert completion(model, prompt=["Once"]).text_input == "Once"
    # A list of prompts (strings or token arrays): one job each, choices numbered prompt by prompt.
    many = check_completion(
        CompletionRequest(model="text_generation", prompt=[[1, 2], [3]], n=2, echo=True), model, SETTINGS, _Vocab()
    )
    assert [(j.prompt_token_ids, j.text_input, j.echo_prefix, j.first_index) for j in [many, *many.siblings]] == [
        ((1, 2), "<1><2>", "<1><2>", 0),
        ((3,), "<3>", "<3>", 2),
    ]
    one_array = check_completion(CompletionRequest(model="text_generation", prompt=[7, 8]), model, SETTINGS, _Vocab())
    assert one_array.prompt_token_ids == (7, 8) and not one_array.siblings
    with pytest.raises(APIError) as err:
        check_completion(CompletionRequest(model="text_generation", prompt=[[1], [100]]), model, SETTINGS, _Vocab())
    assert err.value.param == "prompt" and "token id 100" in err.value.message
    texts = check_completion(CompletionRequest(model="text_generation", prompt=["a", "b"]), model, SETTINGS)
    assert [j.text_input for j in [texts, *texts.siblings]] == ["a", "b"]
    job = completion(model, prompt="Once", echo=True, max_tokens=3)
    assert (job.chat, job.text_input, job.echo_prefix, job.sampling) == (False, "Once", "Once", {"max_tokens": 3})
    assert completion(model, prompt="Once").echo_prefix == ""
    assert job.completion_id.startswith("cmpl-")


# --- SSE chunks ----------------------------------------------------------------------------


def events(raw: bytes) -> list:
    """The data of each SSE event; the last must be [DONE]; each other one JSON."""
    assert raw.endswith(b"\n\n")
    blocks = raw[:-2].split(b"\n\n")
    assert all(b.startswith(b"data: ") for b in blocks), raw
    assert blocks[-1] == b"data: [DONE]"
    assert raw.count(b"[DONE]") == 1
    return [orjson.loads(b[len(b"data: ") :]) for b in blocks[:-1]]


def stream(job, pieces, reason, n_in, n_out) -> bytes:
    w = ChunkWriter(job)
    return w.start() + b"".join(w.text(p) for p in pieces) + w.finish(one(Tally(reason, n_in, n_out)))


def test_chat_chunks_role_text_finish_done(model):
    job = chat(model, stream=True)
    out = events(stream(job, ["Hel", "", "lo!"], "length", 5, 2))
    assert len(out) == 4  # role, two texts (an empty piece sends nothing), the finish
    for e in out:
        assert e["object"] == "chat.completion.chunk"
        assert e["id"] == job.completion_id and e["created"] == job.created and e["model"] == "text_generation"
        assert "usage" not in e  # only with stream_options.include_usage
        assert len(e["choices"]) == 1 and e["choices"][0]["index"] == 0
    deltas = [e["choices"][0]["delta"] for e in out]
    reasons = [e["choices"][0]["finish_reason"] for e in out]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo!"}, {}]
    assert reasons == [None, None, None, "length"]


def test_chat_chunks_with_include_usage_end_with_a_usage_chunk(model):
    job = chat(model, stream=True, stream_options={"include_usage": True})
    out = events(stream(job, ["Hi"], "stop", 9, 1))
    assert len(out) == 4
    # As OpenAI: every chunk carries usage null, the last one has no choices and the usage.
    assert [e["usage"] for e in out[:-1]] == [None, None, None]
    assert out[-2]["choices"][0]["finish_reason"] == "stop"
    assert out[-1]["choices"] == []
    assert out[-1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}


@pytest.mark.parametrize("engine_reason, reason", [("stop", "stop"), ("length", "length"), (None, "stop"), ("abort", "stop")])
def test_the_final_chunk_always_has_an_openai_finish_reason(model, engine_reason, reason):
    out = events(stream(chat(model, stream=True), [], engine_reason, 1, 0))
    assert out[-1]["choices"][0]["finish_reason"] == reason


def test_completion_chunks_and_echo(model):
    job = completion(model, stream=True, max_tokens=4)
    assert ChunkWriter(job).start() == b""  # no role chunk for text completions
    out = events(stream(job, [" there", " was"], "length", 4, 2))
    assert [e["object"] for e in out] == ["text_completion"] * 3
    assert [e["choices"][0]["text"] for e in out] == [" there", " was", ""]
    assert [e["choices"][0]["finish_reason"] for e in out] == [None, None, "length"]

    job = completion(model, prompt="Once", echo=True, stream=True, stream_options={"include_usage": True})
    out = events(stream(job, [" upon"], "stop", 2, 1))
    assert [e["choices"][0]["text"] for e in out[:-1]] == ["Once", " upon", ""]
    assert out[-1]["choices"] == [] and out[-1]["usage"]["total_tokens"] == 3


def test_an_error_after_the_stream_began_is_an_error_event():
    err = APIError(503, "queue full", code="triton_unavailable")
    raw = ChunkWriter.error(err.body())
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert orjson.loads(raw[6:]) == {
        "error": {"message": "queue full", "type": "service_unavailable", "param": None, "code": "triton_unavailable"}
    }


# --- whole bodies --------------------------------------------------------------------------


def test_whole_body_chat(model):
    job = chat(model)
    body = orjson.loads(whole_body(job, {0: "Paris."}, one(Tally("stop", 30, 3))))
    assert body["object"] == "chat.completion" and body["id"] == job.completion_id
    assert body["model"] == "text_generation" and body["created"] == job.created
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Paris.", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}
    cached = orjson.loads(whole_body(job, {0: "Paris."}, one(Tally("stop", 30, 3, cached_tokens=16))))
    assert cached["usage"] == {
        "prompt_tokens": 30,
        "completion_tokens": 3,
        "total_tokens": 33,
        "prompt_tokens_details": {"cached_tokens": 16},
    }


ENTRIES = [
    {
        "token": "Par",
        "logprob": -0.1,
        "bytes": [80, 97, 114],
        "top_logprobs": [{"token": "Par", "logprob": -0.1, "bytes": [80, 97, 114]}],
    },
    {
        "token": "is",
        "logprob": -0.5,
        "bytes": [105, 115],
        "top_logprobs": [{"token": "is", "logprob": -0.5, "bytes": [105, 115]}],
    },
]


def test_logprobs_are_asked_of_the_engine_and_written_in_each_apis_shape(model):
    job = chat(model, logprobs=True, top_logprobs=1)
    assert job.logprobs and job.sampling["logprobs"] == 1
    assert chat(model, logprobs=True).sampling["logprobs"] == 0
    assert "logprobs" not in chat(model, logprobs=False).sampling and not chat(model, logprobs=False).logprobs
    tally = Tally("stop", 30, 2, logprobs=list(ENTRIES))
    body = orjson.loads(whole_body(job, {0: "Paris"}, one(tally)))
    assert body["choices"][0]["logprobs"] == {"content": ENTRIES, "refusal": None}
    # Legacy completions: tokens, token_logprobs, top_logprobs as {token: logprob}, text offsets; with echo
    # the prompt's tokens lead (the first's logprob and top_logprobs null, its text what the others leave).
    legacy = completion(model, prompt="The capital: ", echo=True, logprobs=1)
    assert legacy.sampling["logprobs"] == 1 and legacy.sampling["prompt_logprobs"] == 1
    assert completion(model).logprobs is False and "prompt_logprobs" not in completion(model, echo=True).sampling
    colon = {"token": ": ", "logprob": -2.0, "bytes": [58, 32], "top_logprobs": [{"token": ":", "logprob": -1.0, "bytes": [58]}]}
    echoed = Tally("stop", 3, 2, logprobs=list(ENTRIES), prompt_logprobs=[None, colon])
    body = orjson.loads(whole_body(legacy, {0: "Paris"}, one(echoed)))
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["The capital", ": ", "Par", "is"],
        "token_logprobs": [None, -2.0, -0.1, -0.5],
        "top_logprobs": [None, {":": -1.0}, {"Par": -0.1}, {"is": -0.5}],
        "text_offset": [0, 11, 13, 16],
    }
    unechoed = orjson.loads(whole_body(completion(model, prompt="The capital: ", logprobs=1), {0: "Paris"}, one(tally)))
    assert unechoed["choices"][0]["logprobs"]["text_offset"] == [0, 3]
    # max_tokens 0: the prompt alone, only with echo (the engine then computes the prompt's entries).
    assert completion(model, echo=True, max_tokens=0).sampling == {"max_tokens": 0, "prompt_logprobs": 0}
    assert refused(completion, model, max_tokens=0).param == "max_tokens"
    # Streamed: each chunk carries its own tokens; the offsets go on across chunks.
    writer = ChunkWriter(completion(model, stream=True, logprobs=0))
    first = orjson.loads(writer.text("Par", ENTRIES[:1])[6:])
    second = orjson.loads(writer.text("is", ENTRIES[1:])[6:])
    assert first["choices"][0]["logprobs"]["text_offset"] == [0] and second["choices"][0]["logprobs"]["text_offset"] == [3]
    chat_writer = ChunkWriter(chat(model, stream=True, logprobs=True))
    event = orjson.loads(chat_writer.text("is", ENTRIES[1:])[6:])
    assert event["choices"][0]["logprobs"] == {"content": ENTRIES[1:], "refusal": None}
    assert orjson.loads(chat_writer.text("", ENTRIES[:1])[6:])["choices"][0]["delta"] == {"content": ""}  # EOS's entry
    assert ChunkWriter(chat(model, stream=True)).text("x", None) and ChunkWriter(chat(model, stream=True)).text("", None) == b""


def test_response_format_becomes_the_engines_json_guide(model):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    job = chat(model, response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}})
    assert (
        job.sampling["guided_json"] == {**schema, "additionalProperties": False}
        and job.fields["guided_json"] == "response_format"
    )
    assert chat(model, response_format={"type": "json_object"}).sampling["guided_json"] == {"type": "object"}
    assert "guided_json" not in chat(model, response_format={"type": "text"}).sampling
    # vLLM's own guides pass as extra fields, to the engine that checks them.
    assert chat(model, guided_choice=["a", "b"]).sampling["guided_choice"] == ["a", "b"]
    assert completion(model, guided_regex="[0-9]+").sampling["guided_regex"] == "[0-9]+"


def test_whole_body_completion_with_and_without_echo(model):
    body = orjson.loads(whole_body(completion(model), {0: " there was"}, one(Tally("length", 4, 2))))
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": " there was", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["total_tokens"] == 6
    body = orjson.loads(whole_body(completion(model, prompt="Once", echo=True), {0: " upon"}, one(Tally("stop", 2, 1))))
    assert body["choices"][0]["text"] == "Once upon"


# --- Triton errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status, http",
    [
        ("StatusCode.INVALID_ARGUMENT", 400),
        ("StatusCode.UNAVAILABLE", 503),
        ("StatusCode.NOT_FOUND", 503),
        ("StatusCode.DEADLINE_EXCEEDED", 504),
        ("StatusCode.CANCELLED", 499),
        ("StatusCode.RESOURCE_EXHAUSTED", 413),
        ("StatusCode.INTERNAL", 502),
        ("StatusCode.UNKNOWN", 502),
    ],
)
def test_triton_status_codes_map_to_http(status, http):
    err = triton_error(InferenceServerException("something happened", status=status), "text_embedding")
    assert err.status == http
    assert err.body()["error"]["type"]  # every mapped error has an OpenAI type
    if http == 503:
        assert err.headers.get("Retry-After") == "1"
    if http >= 500:
        assert "something happened" in err.message


def _model_error(exc) -> str:
    """The message a model's shim sends for ``exc`` (python_backends/shim.error_response)."""
    from contract.errors import format_error

    return format_error(exc)


def test_the_models_errors_are_read_as_data_on_a_stream_and_a_unary_call():
    from contract.errors import InputError, Unavailable
    from python_backends.generation.scheduler import ContextTooLong, QueueFull

    cases = [
        (QueueFull(3, 32, 256), 503, None),
        (Unavailable("the model is unloading"), 503, None),
        (InputError("max_tokens", "must be <= 2048, got 5000"), 400, "max_tokens"),
        (InputError("stop", "stop strings must not be empty"), 400, "stop"),
        (ContextTooLong(4086, 16, 4096), 400, "max_tokens"),
        (InputError("text_input", "is 300000 bytes", code="request_too_large"), 413, "messages"),
        (RuntimeError("boom"), 502, None),
    ]
    fields = {"text_input": "messages"}
    for exc, http, param in cases:
        message = _model_error(exc)
        # A stream error has no status; a unary one has the Triton code the shim chose.
        for error in (InferenceServerException(message), InferenceServerException(message, status="StatusCode.INTERNAL")):
            err = triton_error(error, "text_generation", fields)
            assert (err.status, err.param) == (http, param), (exc, err.message)
            assert "#error-data" not in err.message  # the words only reach the client
    err = triton_error(InferenceServerException(_model_error(ContextTooLong(4086, 16, 4096))), "text_generation")
    assert err.code == "context_length_exceeded" and "context limit of 4096" in err.message
    # An indexed field keeps its index: TEXT[3] is input[3].
    err = triton_error(InferenceServerException(_model_error(InputError("TEXT[3]", "text is empty"))), "x", {"TEXT": "input"})
    assert err.param == "input[3]"


def test_a_unary_error_through_the_grpc_door_is_read_from_its_metadata():
    """serve-cluster's gateway calls the gRPC door, which answers the words as details and the data
    as error-data trailing metadata (contract/errors.py)."""
    import grpc

    from contract.errors import ERROR_METADATA, InputError, data_json

    data = InputError("TEXT[3]", "text is empty").data

    class DoorError(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return data.message

        def trailing_metadata(self):
            return ((ERROR_METADATA, data_json(data)),)

    err = triton_error(DoorError(), "x", {"TEXT": "input"})
    assert (err.status, err.param, err.message) == (400, "input[3]", "TEXT[3]: text is empty")


@pytest.mark.parametrize(
    "message, http",
    [
        ("Request for unknown model: 'text_generation' is not found", 503),
        ("Request for unknown model: 'text_generation' version 1 is not ready", 503),
        ("internal error in the engine loop", 502),
        ("failed to connect to all addresses", 502),
        ("Socket closed", 502),
        ("max_tokens: must be <= 2048, got 5000", 502),  # prose without data is never parsed for a field
    ],
)
def test_tritons_own_stream_errors_without_status_or_data(message, http):
    for exc in (InferenceServerException(message), RuntimeError(message)):
        err = triton_error(exc, "text_generation")
        assert err.status == http and err.param is None


def test_a_whole_answer_with_tools_says_what_its_stream_would(model):
    """A list whose first call is valid and second is not: streamed, the first call went out as it
    closed; the whole answer holds the same call, not the text as content."""
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "rm", "arguments": {}}]'
    whole = orjson.loads(whole_body(chat(model, tools=[TOOL]), {0: text}, one(Tally("stop", 5, 9))))["choices"][0]
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    assert whole["message"]["content"] is None and whole["finish_reason"] == "tool_calls"
    writer = ChunkWriter(chat(model, tools=[TOOL], stream=True))
    events = _events(writer.text(text)) + _events(writer.finish(one(Tally("stop", 5, 9))))
    streamed = [d["function"]["name"] for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert streamed == ["get_weather"] and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
