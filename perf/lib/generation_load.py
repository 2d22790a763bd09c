"""Load for streaming generation benchmarks: a system at one concurrency (``Cell``: its requests, each
perf.lib.stats' ``Stream`` record, and its windows; TTFT, ITL and tokens/s with the one percentile),
the prompts (``Workload``), what a system is (``System``), and the closed-loop window that drives
one (``run_window``) and waits until it is idle (``wait_idle``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perf.lib.stats import Stream, inter_token, percentile

__all__ = ["Cell", "Stream", "System", "Workload", "load_workload", "run_window", "wait_idle"]


@dataclass
class Cell:
    """One system at one concurrency: its streams and the windows they ran in."""

    system: str
    concurrency: int
    protocol: str = ""  # in-process, grpc stream, http sse
    streams: list[Stream] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        seconds = sum(b - a for a, b in self.windows)
        tokens = 0
        ttft: list[float] = []
        itl: list[float] = []
        censored = 0
        for s in self.streams:
            sent_inside = next(((a, b) for a, b in self.windows if a <= s.sent <= b), None)
            # A stream sent during a warm-up counts its tokens in the window that follows, not its TTFT.
            window = sent_inside or next(((a, b) for a, b in self.windows if s.sent < a), None)
            if window is None:
                continue
            start, end = window
            inside = [(t, n) for t, n in s.events if start <= t <= end and n > 0]
            tokens += sum(n for _, n in inside)
            if sent_inside is not None:
                if inside and inside[0][0] == s.first:
                    ttft.append(inside[0][0] - s.sent)
                elif not s.error:
                    censored += 1
                    ttft.append(end - s.sent)  # still waiting at the window's end: a lower bound
            itl += inter_token(inside)
        ttft.sort()
        itl.sort()

        def q(values, p):
            return round(1000 * percentile(values, p), 1) if values else None

        errors = [s.error for s in self.streams if s.error] + self.errors
        return {
            "system": self.system,
            "protocol": self.protocol,
            "concurrency": self.concurrency,
            "window_s": round(seconds, 1),
            "requests": len(self.streams),
            "finished": sum(s.finished for s in self.streams),
            "output_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
            "ttft_p50_ms": q(ttft, 50),
            "ttft_p99_ms": q(ttft, 99),
            "ttft_max_ms": q(ttft, 100),
            "ttft_censored": censored,
            "itl_p50_ms": q(itl, 50),
            "itl_p99_ms": q(itl, 99),
            "itl_max_ms": q(itl, 100),
            "errors": len(errors),
            "first_error": errors[0][:300] if errors else "",
        }


@dataclass(frozen=True)
class Workload:
    prompts: list[str]  # chat template applied
    long_prompts: list[tuple[str, int]] = field(default_factory=list)  # (prompt, tokens) of 400+ tokens
    texts: dict[str, str] = field(default_factory=dict)  # each prompt's user message, before the template


def load_workload(path: Path, tokenizer, quick: bool) -> Workload:
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    entries = doc["prompts"]
    if quick:  # a few prompts of each kind, the long ones left out to keep the smoke short
        entries = [e for e in entries if e["kind"] != "long"][::9]

    def render(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    prompts = [render([{"role": "user", "content": e["text"]}]) for e in entries]
    sized = [(p, len(tokenizer.encode(p, add_special_tokens=False))) for p in prompts]
    return Workload(prompts, [(p, n) for p, n in sized if n >= 400], {p: e["text"] for p, e in zip(prompts, entries)})


class System:
    """A way to stream one request; ``stream`` is a coroutine cancelled at the window's end."""

    key = ""

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def prepare(self, concurrency: int) -> None:
        """Before a window at ``concurrency`` (llama-server restarts with --parallel = it)."""

    async def stream(self, prompt: str, max_tokens: int, record: Stream) -> None:
        raise NotImplementedError

    def busy(self) -> bool | None:
        """Whether the system still works on requests (None: cannot tell)."""
        return None


async def run_window(
    system: System,
    concurrency: int,
    duration: float,
    prompts: Sequence[str],
    max_tokens: int,
    start_index: int,
    cell: Cell,
    warmup: float = 0.0,
) -> None:
    """``concurrency`` closed-loop clients for ``warmup + duration`` s, prompts from ``start_index`` on,
    cycled; the first ``warmup`` s are not measured (the cold-start burst: every client's first
    prompt at once). Each request starts with a line naming it, so no system's prefix cache (the
    engine's blocks, llama.cpp's slot cache) spares it the prompt's prefill as the prompts cycle."""
    counter = itertools.count(start_index)
    stop_at = time.perf_counter() + warmup + duration

    async def client():
        while time.perf_counter() < stop_at:
            i = next(counter)
            record = Stream(system.key, concurrency, i % len(prompts), time.perf_counter())
            cell.streams.append(record)
            try:
                label = f"request {system.key}-{time.monotonic_ns()}\n"  # never the same twice, any window
                await system.stream(label + prompts[i % len(prompts)], max_tokens, record)
                record.finished = True
            except asyncio.CancelledError:
                record.cancelled = True
                raise
            except Exception as exc:  # noqa: BLE001 - recorded per request, the window goes on
                record.error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.05)

    started = time.perf_counter() + warmup  # taken first: the clients' first requests are sent at once
    tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
    await asyncio.sleep(started + duration - time.perf_counter())
    ended = time.perf_counter()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    cell.windows.append((started, ended))


def wait_idle(system: System, timeout: float) -> bool:
    """Until the system reports no running or waiting request (a short pause when it cannot tell)."""
    deadline = time.monotonic() + timeout
    time.sleep(0.5)  # cancellations reach the server; its gauges catch up
    while time.monotonic() < deadline:
        busy = system.busy()
        if busy is None:
            time.sleep(1.0)
            return True
        if not busy:
            return True
        time.sleep(0.2)
    return False
