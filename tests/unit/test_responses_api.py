"""The Responses API's parts without a server: input items as chat messages, the chat checks'
fields named as Responses fields, the writer's events, and the bounded stores (SQLite, Redis)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from openai_gateway.completions import Tallies
from openai_gateway.errors import APIError
from openai_gateway.response_store import RedisStore, SQLiteStore
from openai_gateway.responses_api import ResponsesRequest, ResponseWriter, chat_messages, input_items, responses_param
from openai_gateway.tools import Tool, ToolUse


def test_input_items_become_chat_messages_with_their_origin():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    messages, origin = chat_messages(items, first=1)
    assert messages[0] == {"role": "user", "content": "Weather in Paris?"}
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one assistant turn
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert origin == ["previous_response_id", "input[0]", "input[2]"]
    assert responses_param("messages[2].content", origin) == "input[2].content"
    assert responses_param("response_format.json_schema.schema", origin) == "text.format.schema"
    assert responses_param("tools[1].function.name", origin) == "tools[1].name"
    assert responses_param("max_completion_tokens", origin) == "max_output_tokens"
    with pytest.raises(APIError) as caught:
        chat_messages([{"type": "reasoning", "summary": []}], first=0)
    assert caught.value.param == "input[0].type" and caught.value.code == "unsupported_parameter"


def _piece(text: str, reason: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        text=text, index=0, logprobs=None, finish_reason=reason, prompt_tokens=9, completion_tokens=3, cached_tokens=0
    )


def _job(tools: ToolUse | None = None) -> SimpleNamespace:
    return SimpleNamespace(tools=tools, created=1, model=SimpleNamespace(id="text_generation"), logprobs=False)


def test_the_writer_streams_text_and_calls_as_typed_events():
    req = ResponsesRequest(model="text_generation", input="hi")
    writer = ResponseWriter(_job(), req)  # type: ignore[arg-type]
    tallies = Tallies()
    events = writer.start()
    for text, reason in (("Hello", None), (" there", "length")):
        tallies.add(_piece(text, reason))
        events += writer.feed(text)
    events += writer.finish(tallies)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = events[-1]["response"]
    assert (
        final["incomplete_details"] == {"reason": "max_output_tokens"}
        and final["output"][0]["content"][0]["text"] == "Hello there"
    )
    assert final["usage"]["input_tokens"] == 9 and final["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}

    tools = ToolUse((Tool("get_weather", "", {"type": "object"}),), "auto", True)
    writer = ResponseWriter(_job(tools), req)  # type: ignore[arg-type]
    events = writer.feed('[{"name": "get_weather", "arguments": {"city": "Rome"}}')  # sent once its object closes
    assert [e["type"] for e in events][1:3] == ["response.function_call_arguments.delta", "response.function_call_arguments.done"]
    tallies = Tallies()
    tallies.add(_piece("", "stop"))
    done = writer.feed("]") + writer.finish(tallies)
    item = done[-1]["response"]["output"][0]
    assert item["type"] == "function_call" and item["call_id"].startswith("call_") and item["arguments"] == '{"city": "Rome"}'
    assert done[-1]["type"] == "response.completed"


def test_the_sqlite_store_is_bounded_and_outlives_its_process(tmp_path):
    async def run():
        store = SQLiteStore(tmp_path, ttl_s=3600, max_entries=3)
        for i in range(5):
            await store.put(f"resp_{i}", {"response": {"id": f"resp_{i}"}, "input": []})
        kept = [i for i in range(5) if await store.get(f"resp_{i}") is not None]
        assert kept == [2, 3, 4]  # the oldest went first
        assert await store.delete("resp_4") and not await store.delete("resp_4")
        await store.close()
        again = SQLiteStore(tmp_path, ttl_s=3600, max_entries=3)
        assert (await again.get("resp_3"))["response"]["id"] == "resp_3"
        expired = SQLiteStore(tmp_path, ttl_s=0.2, max_entries=3)
        await asyncio.sleep(0.3)
        assert await expired.get("resp_3") is None
        await again.close()
        await expired.close()

    asyncio.run(run())


def test_the_redis_store_is_bounded(redis_server):
    async def run():
        store = RedisStore(redis_server.url, ttl_s=60, max_entries=3, prefix=f"test:{time.time_ns()}:")
        for i in range(5):
            await store.put(f"resp_{i}", {"response": {"id": f"resp_{i}"}, "input": []})
        kept = [i for i in range(5) if await store.get(f"resp_{i}") is not None]
        assert kept == [2, 3, 4]
        assert await store.delete("resp_3") and await store.get("resp_3") is None
        await store.close()

    asyncio.run(run())


def test_a_response_id_cannot_reach_the_redis_stores_index(redis_server):
    """The ids come from the path: "index" names no record, and neither reads nor deletes the
    sorted set that bounds the store."""

    async def run():
        store = RedisStore(redis_server.url, ttl_s=60, max_entries=2, prefix=f"test:{time.time_ns()}:")
        await store.put("resp_0", {"response": {"id": "resp_0"}, "input": []})
        assert await store.get("index") is None
        assert not await store.delete("index")
        for i in range(1, 4):
            await store.put(f"resp_{i}", {"response": {"id": f"resp_{i}"}, "input": []})
        assert [i for i in range(4) if await store.get(f"resp_{i}") is not None] == [2, 3]
        await store.close()

    asyncio.run(run())


def test_a_cancelled_sqlite_call_keeps_the_connection_to_itself(tmp_path):
    """A request cancelled while its store call runs (a client gone mid-stream) leaves that call
    running in its thread: the next one waits for it, never sharing the connection."""
    store = SQLiteStore(tmp_path, ttl_s=3600, max_entries=3)
    running = threading.Event()
    overlapped = []

    def slow_put(response_id: str, body: bytes) -> None:
        running.set()
        time.sleep(0.3)
        running.clear()

    def get(response_id: str) -> None:
        overlapped.append(running.is_set())

    store._put, store._get = slow_put, get  # type: ignore[method-assign]

    async def run():
        put = asyncio.create_task(store.put("resp_0", {}))
        await asyncio.to_thread(running.wait, 1)
        put.cancel()
        await asyncio.gather(put, return_exceptions=True)
        await store.get("resp_0")
        await store.close()

    asyncio.run(run())
    assert overlapped == [False]


def test_input_items_are_stored_in_the_sdks_item_shape():
    """input_items lists what input_items() stores: a text input is a message of input_text
    parts, as OpenAI lists it (the SDK's item type), and still becomes the same chat message."""
    from openai.types.responses import ResponseInputMessageItem

    for given in ("Hello", [{"role": "user", "content": "Hello"}]):
        items = input_items(given)
        item = ResponseInputMessageItem.model_validate(items[0])
        assert item.content[0].type == "input_text" and item.content[0].text == "Hello"
        assert chat_messages(items, first=0)[0] == [{"role": "user", "content": "Hello"}]
    assistant = input_items([{"role": "assistant", "content": "Hi"}])[0]
    assert assistant["content"] == [{"type": "output_text", "text": "Hi", "annotations": []}]
