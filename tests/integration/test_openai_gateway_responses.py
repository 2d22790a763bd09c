"""OpenAI's Responses API on the gateway (``/v1/responses``), through the official openai SDK:
text, instructions, a cut answer, structured output (``text.format`` and ``responses.parse``),
a function call and its output chained with ``previous_response_id``, cached tokens, the typed
events of a stream, the stored responses (SQLite across a restart, Redis), and refusals that
name the field. Every field of the SDK's request is served, refused or listed as ignored."""

from __future__ import annotations

import json
import typing
import uuid

import httpx
import openai
import pytest
from openai.types.responses import response_create_params
from pydantic import BaseModel

from openai_gateway.request_fields import IGNORED, UNSERVED
from openai_gateway.responses_api import RESPONSES_UNSERVED, ResponsesRequest
from tests.integration.conftest import GATEWAY_TEST_KEY

GENERATION = "text_generation"
AUTH = {"Authorization": f"Bearer {GATEWAY_TEST_KEY}"}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# Declared by the schema and refused for some values by the route (named in the 400).
PARTLY_REFUSED = {
    "truncation": "auto",
    "reasoning": {"effort": "high"},
    "include": ["file_search_call.results"],
    "text": {"verbosity": "low"},
}


def test_every_field_of_the_sdks_responses_request_is_served_refused_or_listed():
    fields = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    served = set(ResponsesRequest.model_fields)
    refused = set(RESPONSES_UNSERVED) | set(UNSERVED)
    unplaced = sorted(fields - served - refused - set(IGNORED))
    assert not unplaced, f"fields nobody decided on: {unplaced}"
    assert not served & set(RESPONSES_UNSERVED)


@pytest.mark.parametrize("name", sorted({*RESPONSES_UNSERVED, *PARTLY_REFUSED} - {"messages"}))
def test_a_refused_field_is_a_400_naming_it(gateway, name):
    value = PARTLY_REFUSED.get(name, {"n": 2, "logprobs": True, "background": True}.get(name, {"x": 1}))
    body = {"model": GENERATION, "input": "Hi", "max_output_tokens": 2, name: value}
    r = httpx.post(f"{gateway.url}/v1/responses", json=body, headers=AUTH, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "unsupported_parameter", (r.status_code, error)
    assert error["param"].split(".")[0].split("[")[0] == name, error


def test_text_with_instructions_and_a_cut_answer(openai_client):
    answer = openai_client.responses.create(
        model=GENERATION,
        instructions="You are a geography teacher. Answer in one short sentence.",
        input="What is the capital of France?",
        max_output_tokens=24,
        temperature=0,
        metadata={"suite": "responses"},
    )
    assert answer.id.startswith("resp_") and answer.object == "response" and answer.status == "completed"
    assert "Paris" in answer.output_text, answer.output_text
    message = answer.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    usage = answer.usage
    assert usage.input_tokens > 10 and usage.output_tokens >= 1
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    assert answer.instructions.startswith("You are") and answer.metadata == {"suite": "responses"}
    cut = openai_client.responses.create(
        model=GENERATION, input="Tell me a long story about a dragon.", max_output_tokens=3, temperature=0
    )
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output_text
    scored = openai_client.responses.create(
        model=GENERATION, input="Hi", max_output_tokens=3, include=["message.output_text.logprobs"], top_logprobs=2
    )
    tokens = scored.output[0].content[0].logprobs
    assert len(tokens) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens), tokens


def test_structured_output_through_text_format_and_parse(openai_client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"],
    }
    answer = openai_client.responses.create(
        model=GENERATION,
        input="Name the capital of France and its country as JSON.",
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    value = json.loads(answer.output_text)
    assert set(value) == {"city", "country"}, value

    class Capital(BaseModel):
        city: str
        country: str

    parsed = openai_client.responses.parse(
        model=GENERATION,
        input="Name the capital of Italy and its country.",
        text_format=Capital,
        max_output_tokens=60,
        temperature=0,
    )
    assert isinstance(parsed.output_parsed, Capital), parsed.output_text


def test_a_function_call_and_its_output_chained_with_previous_response_id(openai_client):
    call = openai_client.responses.create(
        model=GENERATION,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
    )
    calls = [item for item in call.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_"), call.output
    assert "city" in json.loads(calls[0].arguments)
    answer = openai_client.responses.create(
        model=GENERATION,
        previous_response_id=call.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}],
        tools=[WEATHER],
        tool_choice="none",  # the answer in words
        max_output_tokens=40,
        temperature=0,
    )
    assert answer.previous_response_id == call.id and answer.output[0].type == "message" and answer.output_text
    kinds = [item.type for item in openai_client.responses.input_items.list(answer.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"], kinds
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.responses.create(model=GENERATION, previous_response_id="resp_nope", input="Hi", max_output_tokens=2)
    error = caught.value.response.json()["error"]
    assert error["param"] == "previous_response_id" and "resp_nope" in error["message"]


def test_a_repeated_long_prompt_reports_cached_tokens(openai_client):
    passage = " ".join(f"{uuid.uuid4().hex[:6]} river" for _ in range(120))  # never sent before
    ask = {"model": GENERATION, "input": f"Repeat the first word of: {passage}", "max_output_tokens": 2, "store": False}
    openai_client.responses.create(**ask)
    again = openai_client.responses.create(**ask)
    prompt, cached = again.usage.input_tokens, again.usage.input_tokens_details.cached_tokens
    assert prompt > 300 and prompt - 16 <= cached <= prompt, (prompt, cached)


def test_stream_events_in_order_and_deltas_add_up_to_the_answer(openai_client):
    with openai_client.responses.stream(
        model=GENERATION,
        input="What is the capital of France? Answer in one short sentence.",
        max_output_tokens=40,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[:4] == head and kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [*tail, "response.completed"]  # the SDK's final response needs it
    assert openai_client.responses.retrieve(final.id).output_text == final.output_text
    # A call streams as its item and arguments events (one call, greedy: sampled parallel calls can run past 40 tokens).
    with openai_client.responses.stream(
        model=GENERATION,
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
        temperature=0,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert final.output[0].type == "function_call" and final.status == "completed"


def test_retrieve_and_delete(openai_client, gateway):
    created = openai_client.responses.create(model=GENERATION, input="Say hi.", max_output_tokens=4)
    assert httpx.get(f"{gateway.url}/v1/responses/{created.id}", timeout=10).status_code == 401  # the key, as on chat
    got = openai_client.responses.retrieve(created.id)
    assert got.id == created.id and got.output_text == created.output_text and got.usage == created.usage
    openai_client.responses.delete(created.id)
    for call in (openai_client.responses.retrieve, openai_client.responses.delete):
        with pytest.raises(openai.NotFoundError) as caught:
            call(created.id)
        assert created.id in caught.value.response.json()["error"]["message"]
    unstored = openai_client.responses.create(model=GENERATION, input="Say hi.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, 400, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
        ({"input": "hi", "use_beam_search": True}, 400, "use_beam_search"),
        ({"input": "x" * 70_000}, 413, "input"),
        ({"input": 7}, 422, "input"),
    ],
)
def test_hostile_bodies_are_4xx_naming_the_field(gateway, body, status, param):
    r = httpx.post(f"{gateway.url}/v1/responses", json={"model": GENERATION, **body}, headers=AUTH, timeout=30)
    assert r.status_code == status and r.json()["error"]["param"].startswith(param), (r.status_code, r.text[:300])


def _client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=GATEWAY_TEST_KEY, max_retries=0, timeout=120)


def test_sqlite_store_outlives_a_gateway_restart(triton, start_gateway, tmp_path):
    args = ("--rate-limit", "0", "--responses-store-dir", str(tmp_path))
    with start_gateway(triton.triton_grpc_url, *args) as gw, _client(gw) as client:  # closed: no connection to drain
        first = client.responses.create(model=GENERATION, input="My name is Ada.", max_output_tokens=8)
    assert (tmp_path / "responses.sqlite3").is_file()
    with start_gateway(triton.triton_grpc_url, *args) as gw, _client(gw) as client:
        assert client.responses.retrieve(first.id).output_text == first.output_text
        then = client.responses.create(
            model=GENERATION, previous_response_id=first.id, input="What is my name?", max_output_tokens=8
        )
        assert then.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_redis_store_holds_the_responses(triton, start_gateway, redis_server):
    import redis

    with (
        start_gateway(triton.triton_grpc_url, "--rate-limit", "0", "--responses-redis", redis_server.url) as gw,
        _client(gw) as client,
    ):
        first = client.responses.create(model=GENERATION, input="My name is Ada.", max_output_tokens=8)
        stored = redis.Redis.from_url(redis_server.url)
        assert stored.exists(f"gateway:responses:r:{first.id}") and stored.ttl(f"gateway:responses:r:{first.id}") > 0
        then = client.responses.create(
            model=GENERATION, previous_response_id=first.id, input="What is my name?", max_output_tokens=8
        )
        assert client.responses.retrieve(then.id).previous_response_id == first.id
        client.responses.delete(first.id)
        assert not stored.exists(f"gateway:responses:r:{first.id}")
        redis_server.kill()
        with pytest.raises(openai.InternalServerError) as caught:  # 503: the store, not the answer's fault
            client.responses.retrieve(then.id)
        assert caught.value.status_code == 503
