"""Two clients that stream one chat answer and report its time to first token and its token count:
through the OpenAI gateway (``/v1/chat/completions``, SSE) and straight to Triton over a gRPC
stream (the project's ``AsyncGenerationClient``). The tail benchmark drives both alike, the
generation benchmark the gateway's (``on_tokens``: each chunk's new tokens as they arrive);
the soak cancels some streams mid-way (``cancel_after``: the client closes the stream after that many
pieces, and ``Cancelled`` says so)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import orjson


class Cancelled(Exception):
    """A stream the client closed on purpose after ``cancel_after`` pieces; ``ttft`` as measured."""

    def __init__(self, ttft: float | None):
        super().__init__("cancelled by the client")
        self.ttft = ttft


class ChatSystem(Protocol):
    """What the benchmarks drive: GatewayChat or DirectChat."""

    async def stream(self, prompt: str, max_tokens: int) -> tuple[float | None, int]: ...


class GatewayChat:
    key = "gateway"

    def __init__(self, session, url: str, api_key: str):
        self.session, self.url = session, f"{url}/v1/chat/completions"
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}

    async def stream(
        self, prompt: str, max_tokens: int, cancel_after: int = 0, on_tokens: Callable[[int, float], None] | None = None
    ) -> tuple[float | None, int]:
        """(TTFT in seconds, completion tokens) of one streamed chat request; ``on_tokens(tokens,
        arrival)`` for each chunk that brings tokens (the usage so far on every chunk: continuous_usage_stats)."""
        body = orjson.dumps(
            {
                "model": "text_generation",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": on_tokens is not None},
            }
        )
        sent = time.perf_counter()
        first = None
        tokens = None
        pieces = seen = 0
        async with self.session.post(self.url, data=body, headers=self.headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                event = orjson.loads(data)
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                if any(c.get("delta", {}).get("content") for c in event.get("choices", ())):
                    first = time.perf_counter() - sent if first is None else first
                    pieces += 1
                    if pieces == cancel_after:
                        resp.close()  # the connection drops: the gateway cancels the Triton stream
                        raise Cancelled(first)
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                    if on_tokens is not None and tokens > seen:
                        on_tokens(tokens - seen, now)
                        seen = tokens
        if tokens is None:
            raise RuntimeError("the stream ended without a usage chunk")
        return first, tokens


class DirectChat:
    key = "direct"

    def __init__(self, client):
        self.client = client  # clients.generation.AsyncGenerationClient, gRPC

    async def stream(self, prompt: str, max_tokens: int, cancel_after: int = 0) -> tuple[float | None, int]:
        sent = time.perf_counter()
        first = None
        pieces = self.client.chat_stream(
            [{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, ignore_eos=True
        )
        count = 0
        async with pieces:
            async for text in pieces:
                if first is None and text:
                    first = time.perf_counter() - sent
                count += 1
                if count == cancel_after:
                    await pieces.aclose()  # cancels the request on the server
                    raise Cancelled(first)
        result = pieces.result
        if result is None or result.num_output_tokens is None:
            raise RuntimeError("the stream ended without a token count")
        return first, result.num_output_tokens
