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


def test_chat_default_max_tokens_is_the_models_limit_or_the_setting(model):
    assert model.max_tokens_limit == 2048
    assert chat(model).sampling == {"max_tokens": 2048}
    assert chat(model, dataclasses.replace(SETTINGS, default_max_tokens=100)).sampling["max_tokens"] == 100
    # A cap below the model's limit also bounds the default.
    assert chat(model, dataclasses.replace(SETTINGS, max_tokens_cap=50)).sampling["max_tokens"] == 50


def test_completions_default_max_tokens_is_16_or_the_setting(model):
    assert COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    assert completion(model).sampling == {"max_tokens": 16}
    assert completion(model, dataclasses.replace(SETTINGS, default_max_tokens=100)).sampling["max_tokens"] == 100


def test_max_completion_tokens_wins_over_max_tokens(model):
    assert chat(model, max_tokens=7).sampling["max_tokens"] == 7
    assert chat(model, max_completion_tokens=9).sampling["max_tokens"] == 9
    assert chat(model, max_tokens=7, max_completion_tokens=9).sampling["max_tokens"] == 9


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2049}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 4096}, "max_completion_tokens"),
        ({"max_tokens": 10, "max_completion_tokens": 5000}, "max_completion_tokens"),
    ],
)
def test_chat_max_tokens_out_of_range_names_the_field_given(model, fields, param):
    err = refused(chat, model, **fields)
    assert (err.status, err.param) == (400, param)


def test_max_tokens_cap_lowers_the_models_limit(model):
    settings = dataclasses.replace(SETTINGS, max_tokens_cap=100)
    assert chat(model, settings, max_tokens=100).sampling["max_tokens"] == 100
    err = refused(chat, model, settings, max_tokens=101)
    assert (err.status, err.param) == (400, "max_tokens") and "<= 100" in err.message
    err = refused(completion, model, settings, max_tokens=101)
    assert (err.status, err.param) == (400, "max_tokens")
    # A cap above the model's limit does not raise it.
    err = refused(chat, model, dataclasses.replace(SETTINGS, max_tokens_cap=10_000), max_tokens=2049)
    assert "<= 2048" in err.message and "max_tokens_limit" in err.message


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
        n=1,
    )
    assert job.sampling == {
        "max_tokens": 20,
        "temperature": 0.0,
        "top_p": 0.9,
        "seed": 42,
        "stop": ["\n\n"],
        "top_k": 5,
        "min_tokens": 2,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
    }
    assert isinstance(job.sampling["temperature"], float)
    assert chat(model, stop=["a", "b"]).sampling["stop"] == ["a", "b"]
    assert "stop" not in chat(model, stop=[]).sampling
    assert chat(model, temperature=2, top_p=1, seed=2**63 - 1).sampling["seed"] == 2**63 - 1


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 2}, "n"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.inf}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"top_k": -1}, "top_k"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 11}, "repetition_penalty"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
    ],
)
@pytest.mark.parametrize("fn", [chat, completion], ids=["chat", "completion"])
def test_sampling_refusals_name_the_field(model, fn, fields, param):
    err = refused(fn, model, **fields)
    assert (err.status, err.param) == (400, param), err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


# --- chat refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, status, param",
    [
        ({"logprobs": True}, 400, "logprobs"),
        ({"top_logprobs": 3}, 400, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({"tool_choice": "auto"}, 400, "tools"),
        ({"functions": [{"name": "f"}]}, 400, "tools"),
        ({"response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, 400, "response_format"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
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
        ({"messages": [{"role": "system", "content": "  "}, {"role": "user", "content": "\n"}]}, 400, "messages"),
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
    chat(model, tool_choice="none", response_format={"type": "text"}, logprobs=False, tools=[])


def test_chat_messages_over_the_models_byte_limit_are_413(model):
    small = dataclasses.replace(model, max_text_bytes=100)
    err = refused(chat, small, messages=[{"role": "user", "content": "é" * 60}])
    assert (err.status, err.param) == (413, "messages") and "max_text_bytes" in err.message


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
        ({"logprobs": 1}, 400, "logprobs"),
        ({"logprobs": 0}, 400, "logprobs"),
        ({"suffix": "end"}, 400, "suffix"),
        ({"prompt": ["one", "two"]}, 400, "prompt"),
        ({"prompt": [1, 2, 3]}, 400, "prompt"),
        ({"prompt": [[1, 2]]}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": " \n\t"}, 400, "prompt"),
        ({"prompt": "x" * 65537}, 413, "prompt"),
    ],
)
def test_completion_refusals(model, fields, status, param):
    err = refused(completion, model, **fields)
    assert (err.status, err.param) == (status, param), err.message


def test_completion_prompt_forms_and_echo(model):
    assert completion(model, prompt=["Once"]).text_input == "Once"
    job = completion(model, prompt="Once", echo=True, max_tokens=3)
    assert (job.chat, job.text_input, job.echo_prefix, job.sampling) == (False, "Once", "Once", {"max_tokens": 3})
    assert completion(model, prompt="Once").echo_prefix == ""
    assert job.completion_id.startswith("cmpl-")
    small = dataclasses.replace(model, max_text_bytes=10)
    err = refused(completion, small, prompt="ééééé é")  # 7 characters, 13 bytes
    assert (err.status, err.param) == (413, "prompt") and "13 bytes" in err.message


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
    return w.start() + b"".join(w.text(p) for p in pieces) + w.finish(reason, n_in, n_out)


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
    body = orjson.loads(whole_body(job, "Paris.", "stop", 30, 3))
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


def test_whole_body_completion_with_and_without_echo(model):
    body = orjson.loads(whole_body(completion(model), " there was", "length", 4, 2))
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": " there was", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["total_tokens"] == 6
    body = orjson.loads(whole_body(completion(model, prompt="Once", echo=True), " upon", "stop", 2, 1))
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


@pytest.mark.parametrize(
    "message, http",
    [
        ("max_waiting=256 requests are waiting; retry later", 503),
        ("Request for unknown model: 'text_generation' is not found", 503),
        ("text_generation is not ready", 503),
        ("the engine is unavailable", 503),
        ("internal error in the engine loop", 502),
        ("failed to connect to all addresses", 502),
        ("Socket closed", 502),
        ("max_tokens: must be <= 2048, got 5000", 400),
        ("prompt is too long", 400),
    ],
)
def test_stream_errors_without_a_status_are_read_from_the_message(message, http):
    for exc in (InferenceServerException(message), RuntimeError(message)):
        assert triton_error(exc, "text_generation").status == http


def test_a_400_names_the_field_from_the_message():
    err = triton_error(
        InferenceServerException("max_tokens: must be <= 2048, got 5000", status="StatusCode.INVALID_ARGUMENT"), "text_generation"
    )
    assert (err.status, err.param, err.message) == (400, "max_tokens", "max_tokens: must be <= 2048, got 5000")
    err = triton_error(InferenceServerException("stop[1]: is empty"), "text_generation")
    assert (err.status, err.param) == (400, "stop[1]")
    # The engine's input names are the request's fields.
    err = triton_error(
        InferenceServerException("text_input: 300000 bytes, the limit is 262144"), "text_generation", {"text_input": "messages"}
    )
    assert (err.status, err.param) == (400, "messages")
    err = triton_error(InferenceServerException("no field here"), "text_generation")
    assert (err.status, err.param) == (400, None)


def test_fit_to_context_cuts_only_a_default_max_tokens():
    from openai_gateway.completions import fit_to_context

    message = "max_tokens: the prompt has 4086 tokens and max_tokens is 16: 4102 exceeds the context limit of 4096 tokens"
    job = completions_job(max_tokens_defaulted=True, max_tokens=16)
    fitted = fit_to_context(job, APIError(400, message, param="max_tokens"))
    assert fitted is not None and fitted.sampling["max_tokens"] == 10 and not fitted.max_tokens_defaulted
    assert job.sampling["max_tokens"] == 16  # the original is untouched
    assert (
        fit_to_context(completions_job(max_tokens_defaulted=False, max_tokens=16), APIError(400, message, param="max_tokens"))
        is None
    )
    assert fit_to_context(job, APIError(400, "max_tokens: must be <= 2048, got 5000", param="max_tokens")) is None
    full = message.replace("4086 tokens", "4096 tokens")  # no room left at all
    assert fit_to_context(job, APIError(400, full, param="max_tokens")) is None
    assert fit_to_context(job, APIError(503, message)) is None


def completions_job(max_tokens_defaulted: bool, max_tokens: int):
    from openai_gateway.completions import GenerationJob

    return GenerationJob(
        model=None,
        chat=False,
        text_input="x",
        sampling={"max_tokens": max_tokens},
        stream=False,
        include_usage=False,
        max_tokens_defaulted=max_tokens_defaulted,
    )


def test_a_job_knows_whether_its_max_tokens_was_a_default(model):
    assert chat(model).max_tokens_defaulted
    assert not chat(model, max_tokens=8).max_tokens_defaulted
    assert not chat(model, max_completion_tokens=8).max_tokens_defaulted
    assert completion(model).max_tokens_defaulted
    assert not completion(model, max_tokens=8).max_tokens_defaulted
