"""The client libraries applications use for structured outputs and tools, unchanged, against the
gateway and a real tritonserver: instructor (its default mode calls a named tool) and
langchain-openai (``with_structured_output`` by JSON schema and by function calling, and
``bind_tools``). The answers are enforced by the engine, so they parse every time."""

from __future__ import annotations

from typing import Annotated

import pydantic
import pytest

from tests.integration.conftest import GATEWAY_TEST_KEY

GENERATION = "text_generation"


class City(pydantic.BaseModel):
    """A city and the country it is in."""

    name: str = pydantic.Field(min_length=1, max_length=30)
    country: str = pydantic.Field(min_length=1, max_length=30)
    landmarks: list[Annotated[str, pydantic.StringConstraints(max_length=30)]] = pydantic.Field(max_length=2)


QUESTIONS = ["Tell me about Paris.", "Describe Tokyo.", "What do you know about Nairobi?"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_instructor_extracts_a_pydantic_model_through_a_named_tool(openai_client):
    import instructor

    client = instructor.from_openai(openai_client)  # instructor's default mode: tools, tool_choice named
    for question in QUESTIONS:
        city = client.chat.completions.create(
            model=GENERATION, response_model=City, messages=[{"role": "user", "content": question}], max_tokens=160, max_retries=0
        )
        assert isinstance(city, City) and city.name


def test_langchain_structured_output_and_tools(gateway):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=GENERATION, base_url=f"{gateway.url}/v1", api_key=GATEWAY_TEST_KEY, max_tokens=160, max_retries=0, timeout=120
    )
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke(QUESTIONS[0])
        assert isinstance(city, City) and city.name, method

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    message = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Oslo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"].get("city"), str)
    # The round trip: the call and its result go back, the model answers in words.
    result = get_weather.invoke(message.tool_calls[0])
    final = llm.bind_tools([get_weather]).invoke([("user", "What is the weather in Oslo?"), message, result], tool_choice="none")
    assert isinstance(final.content, str) and final.content.strip()


@pytest.mark.parametrize("parallel", [True, False])
def test_openai_sdk_tool_calls_whole_and_streamed(openai_client, parallel):
    import json

    tools = [WEATHER_TOOL]
    ask = [{"role": "user", "content": "What is the weather in Oslo and in Rome?"}]
    whole = openai_client.chat.completions.create(
        model=GENERATION, messages=ask, tools=tools, tool_choice="required", parallel_tool_calls=parallel, max_tokens=80
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    assert all(isinstance(json.loads(c.function.arguments)["city"], str) for c in calls)
    assert parallel or len(calls) == 1
    stream = openai_client.chat.completions.create(
        model=GENERATION, messages=ask, tools=tools, tool_choice="required", max_tokens=80, stream=True
    )
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [d for c in deltas if c.delta.tool_calls for d in c.delta.tool_calls]
    assert streamed and streamed[0].function.name == "get_weather" and deltas[-1].finish_reason == "tool_calls"


def test_openai_sdk_stream_helper_gets_content_token_by_token_and_calls_with_tools(openai_client):
    """With tools offered, prose is not held to the end (many content events before the last), and
    an enforced call arrives as the SDK's tool-call events."""
    with openai_client.chat.completions.stream(
        model=GENERATION,
        messages=[{"role": "user", "content": "Write two sentences about the sea."}],
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        max_tokens=40,
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert kinds.count("content.delta") > 3, kinds
    with openai_client.chat.completions.stream(
        model=GENERATION,
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=60,
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    kinds = [event.type for event in events]
    assert "tool_calls.function.arguments.done" in kinds, kinds
    assert not [e.delta for e in events if e.type == "content.delta" and e.delta]  # only the role chunk's empty content
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_langchain_astream_with_tools_streams_prose_and_tool_call_chunks(gateway):
    import asyncio

    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(
        model=GENERATION, base_url=f"{gateway.url}/v1", api_key=GATEWAY_TEST_KEY, max_tokens=60, max_retries=0, timeout=120
    )

    async def both():  # one event loop: the client's connections belong to it
        prose = [c async for c in llm.bind_tools([get_weather]).astream("Write two sentences about the sea.")]
        required = llm.bind_tools([get_weather], tool_choice="required")
        return prose, [c async for c in required.astream("What is the weather in Oslo?")]

    prose, calls = asyncio.run(both())
    assert sum(1 for c in prose if c.content) > 3
    merged = calls[0]
    for c in calls[1:]:
        merged += c
    assert merged.tool_calls and merged.tool_calls[0]["name"] == "get_weather"
    assert isinstance(merged.tool_calls[0]["args"].get("city"), str)
