"""`python -m perf.bench.generate_bench` (`make perf-generate`): text generation, every system side by side.

Streams at concurrency 1, 4, 16 and 32 (closed loop: each client starts its next request
when one ends), 128 new tokens per request with ``ignore_eos`` (so every stream makes
exactly that many), greedy, the checked-in prompts of perf/data/generation_prompts.json
cycled, the model's chat template applied by the benchmark for every system, each request's
prompt starting with a line of its own (``request <system>-<n>``) so that no prefix cache
spares any system a prefill (``--repeat-prompts`` sends them as they are). The served
model and the in-process engine run the weights precision ``--precision`` resolves to
(``PRECISION``, default auto: the best variant gated on this CPU). Systems:

  naive    perf/baselines/naive_generate_server.py: transformers ``generate()`` one request at a time
           behind FastAPI (SSE); the clients are concurrent, the server serialises them;
  engine   the generation engine in this process, no Triton (LLMEngine + EngineLoop, the
           clients submit through EngineLoop.submit): the limit of this design;
  grpc     Triton's ``text_generation`` over a gRPC stream (tritonclient.grpc.aio);
  http     the same over HTTP SSE (``POST /v2/models/text_generation/generate_stream``),
           both through the launcher's front door as clients reach it;
  llama    llama.cpp's ``llama-server`` (built beside the runtime's libraries) on the peers' GGUF:
           the published Q4_1 requantized to Q4_0 by llama.cpp's quantizer, as a llama.cpp user
           does (``--peer-type``; perf/baselines/llama_cpp.py), ``--parallel`` = the concurrency,
           ``--cont-batching``, its ``/completion`` stream (ggml's thread pool, as the runtime's build:
           the same speed as an OpenMP build here);
  openvino OpenVINO GenAI's ``ContinuousBatchingPipeline`` in this process on the same GGUF, stepped
           by one thread as OpenVINO Model Server does (perf/baselines/openvino_genai.py).

The in-process engine takes the served model's config.pbtxt parameters (KV pool, block
size, batch limits), so engine and served model run the same settings.

Each (system, concurrency) cell is a window of --duration seconds: its output tokens per
second are the tokens that arrived in the window over its length; at the window's end
the requests still streaming are cancelled (the benchmark then waits until that system is
idle). The systems take turns at each concurrency, in an order rotated from one level to
the next (and --rounds repeats the grid), so a noisy neighbour hurts them alike; within a
concurrency every system gets the same prompts in the same (shuffled) order. TTFT is
from a request's send to its first token; a request still without one at the window's end
counts with its waiting time so far (a lower bound; the table says how many). Inter-token
latency is the gap between two streamed responses, per token they carry.

Then prefill (``--prefill N``): the long prompts (400+ tokens), one request at a time with
one new token, each starting with a line no other request has (no prefix cache helps),
on engine, grpc, llama and openvino in turn: prompt tokens/s.

Then prefix caching: the shared ~500-token system prompt with a different user message
per request, one at a time, on two in-process engines (same weights) with
enable_prefix_caching on and off, requests alternating between them: TTFT with the
prefix cached (second request onward) over TTFT without.

Prints a table and the ratios the targets are written in (engine / naive tokens/s at 32
streams >= 10, served / engine at every concurrency >= 0.9, served / llama.cpp tokens/s >= 0.9
alone and served / OpenVINO >= 1.0, both >= 1.0 at 16 and 32 streams, TTFT P50 at 16 streams
<= llama.cpp's, cached / uncached TTFT <= 0.3), and writes cells.csv, requests.csv, prefill.csv, prefix.csv, ratios.csv
and summary.md under
perf/results/generate-<UTC time>/. ``--quick``: concurrency 1 and 4, 16 tokens, a few
prompts, short windows (the CI smoke).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import logging
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perf.lib import processes
from perf.lib.harness import write_csv
from perf.lib.paths import GENERATION_PROMPTS, ROOT
from perf.lib.paths import RESULTS as DEFAULT_RESULTS
from perf.lib.stats import percentile

if TYPE_CHECKING:  # imported where they are used: the in-process systems need neither
    import subprocess

    import aiohttp
    import tritonclient.grpc.aio as grpcclient

log = logging.getLogger(__name__)

# The OpenMP wait policy of the served engine (python_backends/generation/__init__.py) for the
# in-process engine and the naive server too; before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MODEL = "text_generation"
DEFAULT_MODEL_DIR = ROOT / "model_repository" / MODEL / "1"
DEFAULT_DATA = GENERATION_PROMPTS
SYSTEMS = ("naive", "engine", "nodraft", "grpc", "http", "llama", "openvino")
PEERS = ("llama", "openvino")
# Measured only when named in --systems.
OPTIONAL_SYSTEMS = ("nodraft",)
SYSTEM_NAMES = {
    "naive": "naive: transformers generate(), one request at a time (FastAPI, SSE)",
    "engine": "engine in-process (LLMEngine + EngineLoop, no Triton)",
    "nodraft": "engine in-process with prompt-lookup drafts off (num_speculative_tokens 0)",
    "grpc": "Triton text_generation, gRPC stream",
    "http": "Triton text_generation, HTTP SSE (generate_stream)",
    "llama": "llama.cpp llama-server on the peers' GGUF (SmolLM2-135M-Instruct, the published Q4_1 requantized by "
    "llama.cpp's quantizer, --peer-type), --parallel = the concurrency, --cont-batching, its /completion stream "
    "(perf/baselines/llama_cpp.py)",
    "openvino": "OpenVINO GenAI ContinuousBatchingPipeline in process on the peers' GGUF, stepped by one thread "
    "(perf/baselines/openvino_genai.py)",
}
PROTOCOLS = {
    "naive": "http sse",
    "engine": "in-process",
    "nodraft": "in-process",
    "grpc": "grpc stream",
    "http": "http sse",
    "llama": "http sse",
    "openvino": "in-process",
}

# The targets, checked (not enforced) in the printed ratios.
TARGET_ENGINE_VS_NAIVE = 10.0
TARGET_SERVED_VS_ENGINE = 0.9
TARGET_CACHED_TTFT = 0.3
# Ours served over each peer, tokens/s per concurrency: >= 0.9x llama.cpp and >= 1.0x OpenVINO alone,
# >= 1.0x the better peer at 16 and 32 streams; TTFT P50 at 16 streams <= llama.cpp's.
TARGET_VS_PEER = {"llama": {1: 0.9, 16: 1.0, 32: 1.0}, "openvino": {1: 1.0, 16: 1.0, 32: 1.0}}
PEER_NAMES = {"llama": "llama.cpp", "openvino": "OpenVINO GenAI"}


# --------------------------------------------------------------------------- records


@dataclass
class Stream:
    """One request as its client saw it (perf_counter seconds)."""

    system: str
    concurrency: int
    prompt_index: int
    sent: float
    events: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in that response)
    finished: bool = False
    cancelled: bool = False
    error: str = ""

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.events)

    @property
    def first(self) -> float | None:
        return next((t for t, n in self.events if n > 0), None)

    def add(self, tokens: int, at: float | None = None) -> None:
        self.events.append((time.perf_counter() if at is None else at, tokens))


@dataclass
class Cell:
    """One system at one concurrency: its streams and the windows they ran in."""

    system: str
    concurrency: int
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
            for (t0, _), (t1, n) in itertools.pairwise(inside):
                itl += [(t1 - t0) / n] * n
        ttft.sort()
        itl.sort()

        def q(values, p):
            return round(1000 * percentile(values, p), 1) if values else None

        errors = [s.error for s in self.streams if s.error] + self.errors
        return {
            "system": self.system,
            "protocol": PROTOCOLS[self.system],
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


# --------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Workload:
    prompts: list[str]  # chat template applied
    prefix_prompts: list[str]  # system prompt + one user message each, chat template applied
    prefix_tokens: int  # tokens of the shared part (the system message as rendered)
    long_prompts: list[tuple[str, int]] = field(default_factory=list)  # (prompt, tokens) of 400+ tokens


def load_workload(path: Path, tokenizer, quick: bool) -> Workload:
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    entries = doc["prompts"]
    if quick:  # a few prompts of each kind, the long ones left out to keep the smoke short
        entries = [e for e in entries if e["kind"] != "long"][::9]

    def render(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    prompts = [render([{"role": "user", "content": e["text"]}]) for e in entries]
    users = doc["prefix_user_messages"][: 2 if quick else None]
    system = {"role": "system", "content": doc["system_prompt"]}
    prefix_prompts = [render([system, {"role": "user", "content": u}]) for u in users]
    a, b = (tokenizer.encode(p, add_special_tokens=False) for p in prefix_prompts[:2])
    shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    sized = [(p, len(tokenizer.encode(p, add_special_tokens=False))) for p in prompts]
    return Workload(prompts, prefix_prompts, shared, [(p, n) for p, n in sized if n >= 400])


# --------------------------------------------------------------------------- the systems


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


def _params(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


class EngineSystem(System):
    def __init__(self, loop, key: str = "engine"):
        self.key = key
        self.loop = loop  # python_backends.generation.engine.EngineLoop
        self._ids = itertools.count()

    async def stream(self, prompt: str, max_tokens: int, record: Stream) -> None:
        from python_backends.generation.sampling import SamplingParams

        aio = asyncio.get_running_loop()
        done = aio.create_future()
        rid = f"bench-{next(self._ids)}"

        def on_output(out) -> None:  # the engine's loop thread: stamp now, hand over the rest
            record.add(len(out.token_ids))
            if out.finished:
                error = out.error

                def finish() -> None:
                    if not done.done():
                        done.set_result(error)

                aio.call_soon_threadsafe(finish)

        self.loop.submit(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), on_output)
        try:
            error = await done
        except asyncio.CancelledError:
            self.loop.abort(rid)
            raise
        if error is not None:
            raise RuntimeError(str(error))

    def busy(self) -> bool:
        stats = self.loop.stats()
        return bool(
            stats.get("num_requests_running", 0) or stats.get("num_requests_waiting", 0) or self.loop.engine.has_unfinished()
        )


async def _sse_events(session, url: str, body: dict):
    """(arrival time, event) of each server-sent ``data:`` event of a streaming POST; a status
    other than 200 or an ``error`` event raises."""
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            now = time.perf_counter()
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            yield now, event


class SseSystem(System):
    """Triton's generate_stream or the naive server (the same interface)."""

    def __init__(self, key: str, url: str, busy: Callable[[], bool | None] = lambda: None, extra: dict | None = None):
        self.key, self.url, self._busy, self.extra = key, url, busy, extra or {}
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_read=600), connector=aiohttp.TCPConnector(limit=0)
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def stream(self, prompt: str, max_tokens: int, record: Stream) -> None:
        # "stream" as an input (top level): the served model answers in pieces only when asked;
        # the naive server always streams on this endpoint and ignores it.
        body = {"text_input": prompt, "stream": True, "parameters": {**_params(max_tokens), **self.extra}}
        seen = 0
        url = f"http://{self.url}/v2/models/{MODEL}/generate_stream"
        async with contextlib.aclosing(_sse_events(self.session, url, body)) as events:  # a return closes the response
            async for now, event in events:
                if "num_output_tokens" in event:  # cumulative in the served model's responses
                    n = int(event["num_output_tokens"]) - seen
                    seen = int(event["num_output_tokens"])
                else:  # the naive server: one event per token
                    n = 1
                record.add(n, now)
                if event.get("finish_reason"):
                    return

    def busy(self) -> bool | None:
        return self._busy()


class LlamaSystem(System):
    """llama.cpp's llama-server on the same model (its GGUF), restarted with ``--parallel`` equal
    to each window's concurrency and ``--cont-batching``; streams through its native
    ``/completion`` endpoint with the prompt as the benchmark templated it (one event per token)."""

    key = "llama"
    CONTEXT_PER_SLOT = 2048  # tokens of KV per parallel slot: the longest prompt plus max_tokens

    def __init__(self, binary: Path, model: Path, log_path: Path, threads: int | None = None):
        self.binary, self.model, self.log_path = binary, model, log_path
        self.threads = threads or os.cpu_count() or 1
        self.process: subprocess.Popen | None = None
        self.parallel = 0
        self.url = ""
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        import aiohttp

        # A fresh connection per stream: llama-server closes a kept-alive one after a stream, and a
        # request written onto it then fails ("Can not write request body").
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_read=600), connector=aiohttp.TCPConnector(limit=0, force_close=True)
        )

    async def prepare(self, concurrency: int) -> None:
        if self.process is not None and self.process.poll() is None and self.parallel == concurrency:
            return
        self._stop()
        import subprocess

        from server.process import free_port

        port = free_port()
        cmd = [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--parallel",
            str(concurrency),
            "--cont-batching",
            "-t",
            str(self.threads),
            "-c",
            str(self.CONTEXT_PER_SLOT * concurrency),
            "--no-webui",
            "--slots",
        ]
        with self.log_path.open("a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            process = self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.parallel, self.url = concurrency, f"127.0.0.1:{port}"
        assert self.session is not None  # open() comes before prepare()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {process.returncode} (log {self.log_path})")
            try:
                async with self.session.get(f"http://{self.url}/health") as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"llama-server not ready after 120 s (log {self.log_path})")

    async def stream(self, prompt: str, max_tokens: int, record: Stream) -> None:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        seen = 0
        async with contextlib.aclosing(_sse_events(self.session, f"http://{self.url}/completion", body)) as events:
            async for now, event in events:
                if event.get("stop"):
                    predicted = int(event.get("tokens_predicted") or seen)
                    if predicted > seen:
                        record.add(predicted - seen, now)
                    return
                seen += 1
                record.add(1, now)

    def busy(self) -> bool | None:
        """Whether a slot is still processing (llama-server's /slots): a cancelled stream's slot must
        be free before the next window, or llama.cpp would take cores from the next system."""
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.url}/slots", timeout=5) as r:
                return any(slot.get("is_processing") for slot in json.loads(r.read()))
        except TimeoutError:
            return True  # too busy to answer
        except urllib.error.URLError as exc:
            return True if isinstance(exc.reason, TimeoutError) else None
        except (OSError, ValueError):
            return None

    def _stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: it is killed instead
                self.process.kill()
                self.process.wait()
        self.process = None

    async def close(self) -> None:
        self._stop()
        if self.session is not None:
            await self.session.close()


class OpenVinoSystem(System):
    """OpenVINO GenAI's ContinuousBatchingPipeline in this process (perf/baselines/openvino_genai.py) on
    the peer's GGUF, fed the benchmark's templated prompt as token ids."""

    key = "openvino"

    def __init__(self, pipeline, tokenizer):
        self.pipeline, self.tokenizer = pipeline, tokenizer

    async def stream(self, prompt: str, max_tokens: int, record: Stream) -> None:
        aio = asyncio.get_running_loop()
        done = aio.create_future()

        def on_done(error: str | None) -> None:  # the pipeline's thread
            def finish() -> None:
                if not done.done():
                    done.set_result(error)

            aio.call_soon_threadsafe(finish)

        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        rid = self.pipeline.submit(ids, max_tokens, lambda n, at: record.add(n, at), on_done)
        try:
            error = await done
        except asyncio.CancelledError:
            self.pipeline.cancel(rid)
            raise
        if error is not None:
            raise RuntimeError(error)

    def busy(self) -> bool:
        return self.pipeline.busy()

    async def close(self) -> None:
        self.pipeline.close()


class GrpcSystem(System):
    key = "grpc"

    def __init__(self, url: str, busy: Callable[[], bool | None] = lambda: None):
        self.url, self._busy = url, busy
        self.client: grpcclient.InferenceServerClient | None = None
        self._ids = itertools.count()

    async def open(self) -> None:
        import tritonclient.grpc.aio as grpcclient

        self.client = grpcclient.InferenceServerClient(self.url)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    def _inputs(self, prompt: str, max_tokens: int):
        import numpy as np
        import tritonclient.grpc.aio as grpcclient

        values = {
            "text_input": np.array([prompt.encode()], dtype=object),
            "stream": np.array([True]),
            "exclude_input_in_output": np.array([True]),
            "return_finish_reason": np.array([True]),
            "return_num_output_tokens": np.array([True]),
            "sampling_parameters": np.array([json.dumps(_params(max_tokens)).encode()], dtype=object),
        }
        inputs = []
        for name, value in values.items():
            t = grpcclient.InferInput(name, list(value.shape), "BYTES" if value.dtype == object else "BOOL")
            t.set_data_from_numpy(value)
            inputs.append(t)
        return inputs

    async def stream(self, prompt: str, max_tokens: int, record: Stream) -> None:
        inputs = self._inputs(prompt, max_tokens)
        rid = f"bench-{next(self._ids)}"

        async def requests():
            yield {"model_name": MODEL, "inputs": inputs, "request_id": rid}

        assert self.client is not None  # open() came first
        responses = self.client.stream_infer(inputs_iterator=requests())
        seen = 0
        try:
            async for result, error in responses:
                now = time.perf_counter()
                if error is not None:
                    raise RuntimeError(f"stream error: {error}")
                count = result.as_numpy("num_output_tokens")
                total = int(count.reshape(-1)[0]) if count is not None else seen + 1
                record.add(total - seen, now)
                seen = total
                reason = result.as_numpy("finish_reason")
                if reason is not None and reason.reshape(-1)[0] not in (b"", "", None):
                    return
        finally:
            responses.cancel()  # ends the call (and the request, if it still runs)

    def busy(self) -> bool | None:
        return self._busy()


def triton_busy(metrics_url: str) -> Callable[[], bool | None]:
    """A probe of the served model's running/waiting gauges on the metrics port (None when absent)."""
    pattern = re.compile(r"^(\w*(?:running|waiting)\w*)\{[^}]*model=\"" + MODEL + r"\"[^}]*\}\s+(\S+)", re.MULTILINE)

    def probe() -> bool | None:
        try:
            with urllib.request.urlopen(metrics_url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
        values = [float(v) for name, v in pattern.findall(text) if "seconds" not in name]
        return None if not values else any(v > 0 for v in values)

    return probe


# --------------------------------------------------------------------------- measuring


async def _window(
    system: System,
    concurrency: int,
    duration: float,
    prompts: Sequence[str],
    max_tokens: int,
    start_index: int,
    cell: Cell,
    unique: bool = True,
    warmup: float = 0.0,
) -> int:
    """``concurrency`` closed-loop clients for ``warmup + duration`` s, prompts from ``start_index`` on,
    cycled; what happens in the first ``warmup`` s is not measured (the cold-start burst: every client's
    first prompt at once). Returns the next prompt index.

    ``unique``: each request starts with a line naming it, so no prompt is ever seen twice and no
    system's prefix cache (the engine's blocks, llama.cpp's slot cache) computes less than the
    whole prompt; the checked-in prompts cycle, and without it the systems that cache across
    requests would skip their prefills."""
    counter = itertools.count(start_index)
    stop_at = time.perf_counter() + warmup + duration

    async def client():
        while time.perf_counter() < stop_at:
            i = next(counter)
            record = Stream(system.key, concurrency, i % len(prompts), time.perf_counter())
            cell.streams.append(record)
            try:
                prompt = prompts[i % len(prompts)]
                label = f"request {system.key}-{time.monotonic_ns()}\n"  # never the same twice, any window
                await system.stream(label + prompt if unique else prompt, max_tokens, record)
                record.finished = True
            except asyncio.CancelledError:
                record.cancelled = True
                raise
            except Exception as exc:  # noqa: BLE001 - recorded per request, the window goes on
                record.error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
    await asyncio.sleep(warmup)
    started = time.perf_counter()
    await asyncio.sleep(duration)
    ended = time.perf_counter()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    cell.windows.append((started, ended))
    return next(counter)


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


class Bench:
    def __init__(self, args: argparse.Namespace, out_dir: Path):
        self.args, self.out_dir = args, out_dir
        self.started = time.monotonic()
        self.cells: dict[tuple[str, int], Cell] = {}
        self.notes: list[str] = []
        self.prefill: list[dict[str, Any]] = []

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:5.0f} s] {message}", flush=True)

    def run_grid(self, systems: dict[str, System], workload: Workload) -> None:
        a = self.args
        order = [k for k in SYSTEMS if k in systems]
        aio = asyncio.new_event_loop()
        try:
            for system in systems.values():
                aio.run_until_complete(system.open())
            for key in order:  # warm-up: first requests allocate; keep them out of the windows
                aio.run_until_complete(systems[key].prepare(a.concurrency[0]))
                warm = Stream(key, 0, 0, time.perf_counter())
                try:
                    aio.run_until_complete(asyncio.wait_for(systems[key].stream(workload.prompts[0], 4, warm), 120))
                except Exception as exc:  # noqa: BLE001 - its windows will say so too
                    self.say(f"    warm-up of {key} failed: {exc}")
            turn = 0
            # Every system of a (round, concurrency) gets the same prompts in the same order: a window
            # that drew the long prompts would otherwise do several times the prefill of its neighbour's.
            order_of_prompts = list(range(len(workload.prompts)))
            random.Random(20261203).shuffle(order_of_prompts)  # the kinds (short, long, code) mixed
            prompts = [workload.prompts[i] for i in order_of_prompts]
            for rnd in range(a.rounds):
                for c in a.concurrency:
                    start = (rnd * len(a.concurrency) + a.concurrency.index(c)) * 17 % len(prompts)
                    for key in order[turn % len(order) :] + order[: turn % len(order)]:
                        cell = self.cells.setdefault((key, c), Cell(key, c))
                        aio.run_until_complete(systems[key].prepare(c))
                        aio.run_until_complete(
                            _window(
                                systems[key],
                                c,
                                a.duration,
                                prompts,
                                a.max_tokens,
                                start,
                                cell,
                                unique=not a.repeat_prompts,
                                warmup=a.warmup,
                            )
                        )
                        idle = wait_idle(systems[key], a.idle_timeout)
                        if not idle:
                            cell.errors.append(f"still busy {a.idle_timeout:.0f} s after the window")
                        s = cell.summary()
                        self.say(
                            f"  round {rnd + 1} c{c:<3} {key:<6} {s['tokens_per_s']} tokens/s, "
                            f"TTFT p50 {s['ttft_p50_ms']} ms, ITL p50 {s['itl_p50_ms']} ms"
                            + ("" if idle else " (did not become idle)")
                        )
                    turn += 1
            if a.prefill and workload.long_prompts:
                self.prefill = aio.run_until_complete(measure_prefill(systems, workload, a.prefill, self.say))
        finally:
            for system in systems.values():
                aio.run_until_complete(system.close())
            aio.close()


PREFILL_SYSTEMS = ("engine", "grpc", "llama", "openvino")


async def measure_prefill(systems: dict[str, System], workload: Workload, count: int, say) -> list[dict[str, Any]]:
    """Prompt tokens/s: the long prompts (400+ tokens) one request at a time, one new token each,
    the systems taking turns per prompt. Each request starts with a line no other request has, so
    no prefix cache (the engine's blocks, llama.cpp's slot cache) holds any of it: TTFT is the
    whole prompt's prefill plus one decode step and the transport."""
    rows: list[dict[str, Any]] = []
    chosen = [k for k in PREFILL_SYSTEMS if k in systems]
    for i, (prompt, tokens) in enumerate(workload.long_prompts[:count]):
        for key in chosen[i % len(chosen) :] + chosen[: i % len(chosen)]:
            await systems[key].prepare(1)
            record = Stream(key, 1, i, time.perf_counter())
            nonce = f"request {key}-{i}-{time.monotonic_ns()}\n"
            try:
                await asyncio.wait_for(systems[key].stream(nonce + prompt, 1, record), 300)
            except Exception as exc:  # noqa: BLE001 - recorded, the others go on
                say(f"    prefill {key} prompt {i}: {type(exc).__name__}: {exc}")
                continue
            if record.first is not None:
                ttft = record.first - record.sent
                rows.append(
                    {
                        "system": key,
                        "prompt": i,
                        "prompt_tokens": tokens,
                        "ttft_ms": round(1000 * ttft, 1),
                        "prompt_tokens_per_s": round(tokens / ttft, 1),
                    }
                )
    for key in chosen:
        mine = [r for r in rows if r["system"] == key]
        if mine:
            say(
                f"  prefill {key:<6} median {statistics.median(r['prompt_tokens_per_s'] for r in mine):.0f} prompt "
                f"tokens/s over {len(mine)} prompts of {min(r['prompt_tokens'] for r in mine)}-"
                f"{max(r['prompt_tokens'] for r in mine)} tokens"
            )
    return rows


def prefill_summary(rows: Sequence[dict]) -> list[dict[str, Any]]:
    out = []
    for key in PREFILL_SYSTEMS:
        mine = [r for r in rows if r["system"] == key]
        if mine:
            out.append(
                {
                    "system": key,
                    "prompts": len(mine),
                    "prompt_tokens_per_s_p50": round(statistics.median(r["prompt_tokens_per_s"] for r in mine), 1),
                    "ttft_p50_ms": round(statistics.median(r["ttft_ms"] for r in mine), 1),
                }
            )
    return out


def measure_prefix(engine, workload: Workload, max_tokens: int, say) -> list[dict[str, Any]]:
    """TTFT of the shared-system-prompt requests on two engines (prefix caching on / off),
    the same weights, one request at a time, alternating."""
    from python_backends.generation.engine import LLMEngine
    from python_backends.generation.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engines = {}
    for on in (True, False):
        # A small pool: one request at a time plus the cached prefix (zeroing the served 1 GiB twice costs seconds).
        cfg = dataclasses.replace(
            engine.config,
            enable_prefix_caching=on,
            num_blocks=None,
            kv_cache_bytes=min(engine.config.kv_cache_bytes, 128 * 2**20),
        )
        engines[on] = LLMEngine(cfg, weights=engine.weights, tokenizer=engine.tokenizer)
        # A first request that shares nothing with the measured ones: the pool's pages and the
        # runner's workspaces are touched here, not in the first measured request.
        engines[on].generate(["Hello! Write one word."], params)
    rows = []
    for i, prompt in enumerate(workload.prefix_prompts):
        for on in (True, False) if i % 2 == 0 else (False, True):
            e = engines[on]
            before = e.stats()
            rid = f"prefix-{on}-{i}"
            sent = time.perf_counter()
            e.add_request(rid, prompt, params)
            first = None
            while e.has_unfinished():
                for out in e.step():
                    if first is None and out.token_ids:
                        first = time.perf_counter()
            after = e.stats()
            computed = after.get("prompt_tokens_computed", 0) - before.get("prompt_tokens_computed", 0)
            rows.append(
                {
                    "request": i,
                    "prefix_caching": "on" if on else "off",
                    "prompt_tokens": len(e.tokenizer.encode(prompt, add_special_tokens=False)),
                    "prompt_tokens_computed": computed,
                    "ttft_ms": round(1000 * (first - sent), 1) if first else None,
                }
            )
    say(f"    prefix: {len(rows)} requests, shared prefix {workload.prefix_tokens} tokens")
    return rows


def prefix_summary(rows: Sequence[dict]) -> dict[str, Any]:
    """Medians over the second request onward (the first one fills the cache)."""

    def med(on: str) -> float | None:
        values = sorted(r["ttft_ms"] for r in rows if r["prefix_caching"] == on and r["request"] > 0 and r["ttft_ms"])
        return percentile(values, 50) if values else None

    on, off = med("on"), med("off")
    first = next((r["ttft_ms"] for r in rows if r["prefix_caching"] == "on" and r["request"] == 0), None)
    computed_on = [r["prompt_tokens_computed"] for r in rows if r["prefix_caching"] == "on" and r["request"] > 0]
    prompt = [r["prompt_tokens"] for r in rows if r["prefix_caching"] == "on" and r["request"] > 0]
    return {
        "ttft_cached_p50_ms": on,
        "ttft_uncached_p50_ms": off,
        "ttft_first_on_ms": first,
        "mean_prompt_tokens": round(sum(prompt) / len(prompt), 1) if prompt else None,
        "mean_prompt_tokens_computed_cached": round(sum(computed_on) / len(computed_on), 1) if computed_on else None,
        "ratio": round(on / off, 3) if on and off else None,
    }


def run_genai_perf(
    exe: Path,
    grpc_url: str,
    tokenizer_dir: Path,
    out_dir: Path,
    prompts: Sequence[str],
    concurrency: int,
    max_tokens: int,
    requests: int,
    timeout: float,
) -> dict[str, Any]:
    """NVIDIA's genai-perf (its own venv: ``exe``) against the served model over a gRPC stream.

    The benchmark's prompts (an --input-file; its synthetic prompts can come out empty,
    which the served model refuses and perf_analyzer then stops). The sampling parameters go as a
    typed JSON input (--extra-inputs) that says exactly what runs (genai-perf's own
    --output-tokens-mean writes ``{"max_tokens": "128"}``, numbers as strings, which the
    served model converts as the vLLM backend does).
    No warm-up requests: perf_analyzer 2.50 with --warmup-request-count 1 at concurrency 4
    never finished against it (without, the same run took 3 s)."""
    import subprocess

    from perf.lib import perf_analyzer as pa

    _, env = pa.check()  # libcudart for perf_analyzer
    env = {**env, "PATH": os.pathsep.join((str(Path(exe).parent), env.get("PATH", ""))), "HF_HUB_OFFLINE": "1"}
    artifacts = out_dir / "genai-perf"
    inputs = out_dir / "genai-perf-input"
    inputs.mkdir(exist_ok=True)
    (inputs / "prompts.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    sampling = json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    cmd = [
        str(exe),
        "profile",
        "-m",
        MODEL,
        "--backend",
        "vllm",
        "--endpoint-type",
        "kserve",
        "--streaming",
        "-u",
        grpc_url,
        "--tokenizer",
        str(tokenizer_dir),
        "--input-file",
        str(inputs),
        "--extra-inputs",
        json.dumps({"sampling_parameters": sampling}),
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(requests),
        "--warmup-request-count",
        "0",
        "--num-dataset-entries",
        str(max(requests, 8)),
        "--artifact-dir",
        str(artifacts),
    ]
    row: dict[str, Any] = {"concurrency": concurrency, "requests": requests, "command": " ".join(cmd[1:])}
    log_path = out_dir / "genai-perf.log"
    with log_path.open("w") as log_file:
        # Its own session: on a timeout, perf_analyzer (genai-perf's child) goes too.
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=out_dir, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    output = log_path.read_text(errors="replace")
    found = sorted(artifacts.rglob("*_genai_perf.json"))
    if code != 0 or not found:
        tail = [line.strip() for line in output.splitlines() if line.strip()][-3:]
        why = f"no result after {timeout:.0f} s" if code is None else f"exit {code}"
        return {**row, "error": f"{why}: {' | '.join(tail)}"[:300]}
    stats = json.loads(found[-1].read_text())

    def get(metric, stat):
        value = (stats.get(metric) or {}).get(stat)
        return None if value is None else round(float(value), 2)

    return {
        **row,
        "error": "",
        "tokens_per_s": get("output_token_throughput", "avg"),
        "ttft_p50_ms": get("time_to_first_token", "p50"),
        "ttft_p99_ms": get("time_to_first_token", "p99"),
        "itl_p50_ms": get("inter_token_latency", "p50"),
        "itl_p99_ms": get("inter_token_latency", "p99"),
        "output_tokens_p50": get("output_sequence_length", "p50"),
    }


OV_MATRIX = {"FullyConnected", "MatMul", "Gemm"}  # OpenVINO CPU node types: the weights' products
OV_ATTENTION = {"PagedAttentionExtension", "PagedAttention"}


def profile_step(
    engine, prompts: Sequence[str], batch: int, steps: int, steady: bool = False, warm_steps: int = 150
) -> dict[str, Any]:
    """Where a step of ``batch`` streams spends its time (torch.profiler on ``steps`` steps).

    Decode-only (``steady`` False): every prompt prefilled first, then ``steps`` decode steps.
    ``steady``: the served workload in-process, a closed loop of ``batch`` streams of 128 tokens
    (``ignore_eos``) over every prompt (the long ones too), each request with a line of its own
    so the prefix cache spares nothing, a finished stream replaced at once; ``warm_steps`` steps
    first, so the window holds decodes of mixed context lengths and the prompt chunks of new
    requests, as a serving step does.

    ``matrix``: the matrix products (the weights' share); ``attention``: the paged attention's
    gathers and its attention kernel; ``other ops``: every other ATen op (norms, RoPE, SiLU,
    casts, sampling); ``outside ops``: the rest of the step's wall time, i.e. Python in the
    scheduler, block manager, runner, sampler and detokenizer plus op dispatch. Self times,
    main thread. On the OpenVINO runtime the forward pass's nodes come from OpenVINO's own
    counters (the runner is recompiled with them on): ``FullyConnected``/``MatMul`` nodes are
    ``matrix``, ``PagedAttentionExtension`` is ``attention``, the rest ``other ops``; where the
    counters add up to more than the runner's wall time they share that time out. A runtime
    without such counters (llama.cpp) leaves the three columns empty: its forward pass is
    ``runner_ms``."""
    from torch.profiler import ProfilerActivity, profile

    from python_backends.generation.model_runner import ModelRunner
    from python_backends.generation.sampling import SamplingParams

    params = SamplingParams(max_tokens=128 if steady else steps + 40, temperature=0.0, ignore_eos=True)
    ids = itertools.count()
    live: list[str] = []
    runner = engine.runner
    node_split = hasattr(runner, "node_times")  # the OpenVINO runtime: its own per-node counters
    torch_split = isinstance(runner, ModelRunner)
    if node_split:
        runner.enable_node_profiling()  # before the warm-up: the recompiled model's first inferences are slow

    def add() -> None:
        n = next(ids)
        rid = f"profile-{n}"
        label = f"request profile-{n}-{time.monotonic_ns()}\n" if steady else ""
        engine.add_request(rid, label + prompts[n % len(prompts)], params)
        live.append(rid)

    def refill() -> None:
        live[:] = [r for r in live if (seq := engine.scheduler.get(r)) is not None and not seq.is_finished]
        while steady and len(live) < batch:
            add()

    for _ in range(batch):
        add()
    if steady:
        for _ in range(warm_steps):
            engine.step()
            refill()
    else:
        while any(not seq.output_tokens for r in live if (seq := engine.scheduler.get(r)) is not None):
            engine.step()  # every prompt prefilled: what follows is decode steps only
        for _ in range(3):
            engine.step()
    runner_s = 0.0
    execute = runner.execute
    nodes: dict[str, tuple[float, int]] = {}

    def timed(plan):
        nonlocal runner_s
        t = time.perf_counter()
        try:
            return execute(plan)
        finally:
            runner_s += time.perf_counter() - t
            if node_split:
                for kind, (s, n) in runner.node_times().items():
                    total, count = nodes.get(kind, (0.0, 0))
                    nodes[kind] = (total + s, count + n)

    engine.runner.execute = timed
    wall = 0.0
    contexts: list[int] = []
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                contexts += [seq.num_tokens for r in live if (seq := engine.scheduler.get(r)) is not None]
                started = time.perf_counter()
                engine.step()
                wall += time.perf_counter() - started
                refill()  # new requests' tokenization is the client's side, not the step's
    finally:
        engine.runner.execute = execute
        for r in live:
            engine.abort(r)
    from python_backends.generation.linear import PRODUCT_OPS

    matrix = {*PRODUCT_OPS, "aten::bmm"}
    attention = {
        "aten::index_select",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_softmax",
        "aten::_safe_softmax",
        "aten::scaled_dot_product_attention",
    }
    groups = {"matrix": 0.0, "attention": 0.0, "other ops": 0.0}
    top = []
    for e in prof.key_averages():
        us = e.self_cpu_time_total
        groups["matrix" if e.key in matrix else "attention" if e.key in attention else "other ops"] += us / 1e6
        top.append((us, e.key, e.count))
    # OpenVINO's counters can add up to more than the inference's wall time (a node's time on both
    # threads): then they only share out the runner's time.
    scale = min(1.0, runner_s / max(sum(s for s, _ in nodes.values()), 1e-9))
    for kind, (s, n) in nodes.items():  # the OpenVINO runtime's nodes, all steps summed
        groups["matrix" if kind in OV_MATRIX else "attention" if kind in OV_ATTENTION else "other ops"] += s * scale
        top.append((s * 1e6, f"ov::{kind}", n))
    in_ops = sum(groups.values())
    per = 1000.0 / steps
    out = {
        "batch": batch,
        "mode": "steady" if steady else "decode",
        "steps": steps,
        "mean_context": round(sum(contexts) / max(len(contexts), 1)),
        "max_context": max(contexts, default=0),
        "step_ms": round(wall * per, 2),
        "runner_ms": round(runner_s * per, 2),
        "engine_outside_runner_ms": round((wall - runner_s) * per, 2),
    }
    split = torch_split or node_split
    for k, v in groups.items():
        out[f"{k.replace(' ', '_')}_ms"] = round(v * per, 2) if split else ""
    if not split:  # the runtime's own ops are not seen: whatever ran outside it is what is known
        in_ops = runner_s
    out["outside_ops_ms"] = round((wall - in_ops) * per, 2)
    # Op calls per step (nested ones included): what the Python and dispatch cost scales with, and not noisy.
    out["ops_per_step"] = sum(n for _, _, n in top) // steps
    out["top_ops"] = "; ".join(
        f"{k} {us / 1000 * per / 1000:.2f} ms ({n // steps}/step)" for us, k, n in sorted(top, reverse=True)[:8]
    )
    return out


# --------------------------------------------------------------------------- set-up


def split_openvino_config(items: Sequence[str]) -> tuple[dict[str, object], dict[str, str]]:
    """--openvino-config KEY=VALUE items: (SchedulerConfig fields, CPU plugin properties as given)."""
    from perf.baselines.openvino_genai import SCHEDULER_DEFAULTS

    scheduler: dict[str, object] = {}
    plugin: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--openvino-config {item!r}: expected KEY=VALUE")
        if key not in SCHEDULER_DEFAULTS:
            plugin[key] = value
        elif isinstance(SCHEDULER_DEFAULTS[key], bool):
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--openvino-config {key}: expected true or false, got {value!r}")
            scheduler[key] = value.lower() == "true"
        else:
            try:
                scheduler[key] = type(SCHEDULER_DEFAULTS[key])(value)
            except ValueError:
                raise ValueError(f"--openvino-config {key}: expected a number, got {value!r}") from None
    return scheduler, plugin


def resolve_precision(repository: Path, precision: str) -> tuple[str | None, str]:
    """(Triton's --model-config-name, the weights precision served) for PRECISION (export/variants.py)."""
    from export import variants

    config_name, served = variants.resolve_precision(repository, [MODEL], precision, gpu=False)
    return config_name, served[MODEL]


def served_engine_settings(repository: Path, config_name: str | None = None) -> dict:
    """EngineConfig keyword arguments from the parameters of the config Triton serves
    (``configs/<config_name>.pbtxt`` when it exists, else config.pbtxt)."""
    from contract.model_config import ModelConfig
    from ops.rollout import config_from_disk
    from python_backends.generation.serving import engine_settings

    path = repository / MODEL / "config.pbtxt"
    if not path.is_file():
        return {}
    cfg = ModelConfig(config_from_disk(repository, MODEL, config_name))
    settings = engine_settings(cfg.param, cfg.param_int, cfg.param_bool)
    if settings["dtype"] == "auto":  # what the served model picks on a CPU instance
        settings["dtype"] = "float32"
    return settings


def start_engine(model_dir: Path, settings: dict):
    from python_backends.generation.engine import EngineConfig, EngineLoop, LLMEngine

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), device="cpu", **settings))
    return engine, EngineLoop(engine)


def start_triton(model_dir: Path, workdir: Path, config_name: str | None = None):
    """tritonserver with only text_generation (the launcher's code path, front door included).

    With --model-dir elsewhere than the version folder, a temporary repository holds the
    model's config.pbtxt and model.py with links to those weights."""
    from server.process import ServerOptions, TritonServer

    repository = ROOT / "model_repository"
    if model_dir.resolve() != DEFAULT_MODEL_DIR.resolve():
        repository = workdir / "repository"
        version = repository / MODEL / "1"
        version.mkdir(parents=True)
        shutil.copy(ROOT / "model_repository" / MODEL / "config.pbtxt", repository / MODEL / "config.pbtxt")
        if (ROOT / "model_repository" / MODEL / "configs").is_dir():
            shutil.copytree(ROOT / "model_repository" / MODEL / "configs", repository / MODEL / "configs")
        for f in (ROOT / "model_repository" / MODEL / "1").glob("*.py"):
            shutil.copy(f, version / f.name)
        for f in model_dir.iterdir():
            (version / f.name).symlink_to(f.resolve())
    server = TritonServer(
        ServerOptions.with_free_ports(
            workdir=workdir, models=(MODEL,), model_repository=repository, model_config_name=config_name
        )
    )
    return server.start()


# --------------------------------------------------------------------------- report


def _fmt(value, digits: int = 1) -> str:
    if value is None or value == "":
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def ratios(
    args, summaries: dict[tuple[str, int], dict], prefix: dict | None, prefill: Sequence[dict] = ()
) -> list[dict[str, Any]]:
    def tps(key, c):
        s = summaries.get((key, c))
        return s["tokens_per_s"] if s and s["tokens_per_s"] else None

    def ratio(name, num, den, target=None, above=True, detail=""):
        value = round(num / den, 3) if num and den else None
        met = None if value is None or target is None else (value >= target if above else value <= target)
        return {
            "name": name,
            "value": value,
            "target": "" if target is None else f"{'>=' if above else '<='} {target:g}",
            "met": "" if met is None else ("yes" if met else "no"),
            "detail": detail,
        }

    top = max(args.concurrency)
    out = []
    for c in sorted(args.concurrency, reverse=True):
        e, n = tps("engine", c), tps("naive", c)
        out.append(
            ratio(
                f"engine / naive tokens/s, {c} streams",
                e,
                n,
                TARGET_ENGINE_VS_NAIVE if c == top else None,
                detail=f"{_fmt(e)} / {_fmt(n)}",
            )
        )
    for c in sorted(args.concurrency, reverse=True):
        for key in ("grpc", "http"):
            s, e = tps(key, c), tps("engine", c)
            out.append(
                ratio(
                    f"Triton {key} / engine tokens/s, {c} streams", s, e, TARGET_SERVED_VS_ENGINE, detail=f"{_fmt(s)} / {_fmt(e)}"
                )
            )
    for c in sorted(args.concurrency, reverse=True):  # prompt-lookup drafts on over off
        e, n = tps("engine", c), tps("nodraft", c)
        if e and n:
            out.append(ratio(f"engine drafts on / off tokens/s, {c} streams", e, n, detail=f"{_fmt(e)} / {_fmt(n)}"))
    for c in sorted(args.concurrency, reverse=True):  # the peers: ours over each
        for peer_key in PEERS:
            peer = summaries.get((peer_key, c))
            if not peer:
                continue
            name = PEER_NAMES[peer_key]
            for key in ("grpc", "http", "engine"):
                ours = summaries.get((key, c))
                if not ours:
                    continue
                who = "engine" if key == "engine" else f"Triton {key}"
                out.append(
                    ratio(
                        f"{who} / {name} tokens/s, {c} streams",
                        ours["tokens_per_s"],
                        peer["tokens_per_s"],
                        TARGET_VS_PEER[peer_key].get(c) if key != "engine" else None,
                        detail=f"{_fmt(ours['tokens_per_s'])} / {_fmt(peer['tokens_per_s'])}",
                    )
                )
                if key == "engine":
                    continue
                out.append(
                    ratio(
                        f"{who} / {name} TTFT P50 (lower is better), {c} streams",
                        ours["ttft_p50_ms"],
                        peer["ttft_p50_ms"],
                        1.0 if c == 16 and peer_key == "llama" else None,
                        above=False,
                        detail=f"{_fmt(ours['ttft_p50_ms'])} / {_fmt(peer['ttft_p50_ms'])} ms",
                    )
                )
                out.append(
                    ratio(
                        f"{who} / {name} ITL P99 (lower is better), {c} streams",
                        ours["itl_p99_ms"],
                        peer["itl_p99_ms"],
                        detail=f"{_fmt(ours['itl_p99_ms'])} / {_fmt(peer['itl_p99_ms'])} ms",
                    )
                )
    peer = next((r for r in prefill if r["system"] == "llama"), None)
    for r in prefill:
        if peer is not None and r is not peer:
            out.append(
                ratio(
                    f"prefill {r['system']} / llama.cpp prompt tokens/s (P50, one long prompt at a time)",
                    r["prompt_tokens_per_s_p50"],
                    peer["prompt_tokens_per_s_p50"],
                    detail=f"{_fmt(r['prompt_tokens_per_s_p50'])} / {_fmt(peer['prompt_tokens_per_s_p50'])}",
                )
            )
    if prefix is not None:
        out.append(
            ratio(
                "TTFT prefix cached / uncached (engine, P50)",
                prefix["ttft_cached_p50_ms"],
                prefix["ttft_uncached_p50_ms"],
                TARGET_CACHED_TTFT,
                above=False,
                detail=f"{_fmt(prefix['ttft_cached_p50_ms'])} / {_fmt(prefix['ttft_uncached_p50_ms'])} ms",
            )
        )
    return out


def markdown(header: Sequence[str], cells: Sequence[dict], ratio_rows: Sequence[dict], prefix: dict | None) -> str:
    lines = list(header) + [
        "",
        (
            "| system | concurrency | tokens/s | TTFT P50 ms | TTFT P99 ms | TTFT max ms | ITL P50 ms | ITL P99 ms | "
            "ITL max ms | requests (finished) | notes |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for s in cells:
        notes = []
        if s["ttft_censored"]:
            notes.append(f"{s['ttft_censored']} still waiting at the window's end (TTFT a lower bound)")
        if s["errors"]:
            notes.append(f"{s['errors']} errors: {s['first_error'][:120]}")
        lines.append(
            f"| {s['system']} | {s['concurrency']} | {_fmt(s['tokens_per_s'])} | {_fmt(s['ttft_p50_ms'])} | "
            f"{_fmt(s['ttft_p99_ms'])} | {_fmt(s['ttft_max_ms'])} | {_fmt(s['itl_p50_ms'])} | "
            f"{_fmt(s['itl_p99_ms'])} | {_fmt(s['itl_max_ms'])} | {s['requests']} ({s['finished']}) | "
            f"{'; '.join(notes)} |"
        )
    if prefix is not None:
        lines += [
            "",
            "| prefix caching (engine, one request at a time) | TTFT P50 ms | prompt tokens computed |",
            "| --- | ---: | ---: |",
            (
                f"| on, second request onward | {_fmt(prefix['ttft_cached_p50_ms'])} | "
                f"{_fmt(prefix['mean_prompt_tokens_computed_cached'])} of {_fmt(prefix['mean_prompt_tokens'])} |"
            ),
            f"| on, first request (fills the cache) | {_fmt(prefix['ttft_first_on_ms'])} | |",
            f"| off | {_fmt(prefix['ttft_uncached_p50_ms'])} | {_fmt(prefix['mean_prompt_tokens'])} |",
        ]
    lines += ["", "| ratio | value | target | met | from |", "| --- | ---: | --- | --- | --- |"]
    for r in ratio_rows:
        lines.append(f"| {r['name']} | {_fmt(r['value'], 2)} | {r['target']} | {r['met']} | {r['detail']} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.generate_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="concurrency 1 and 4, 16 tokens, a few prompts, 4 s windows (CI smoke; figures are rough)",
    )
    p.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        help="comma-separated stream counts (default 1,8,16,32; --quick 1,4)",
    )
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 128, --quick 16)")
    p.add_argument("--duration", type=float, help="seconds per (system, concurrency) window (default 30, --quick 4)")
    p.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="seconds the clients run before each window is measured (default 0: the window starts with "
        "every client's first request at once, a cold-start burst; e.g. 30 for the steady state)",
    )
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole grid (default 1)")
    p.add_argument(
        "--systems",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=None,
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default all but nodraft)",
    )
    p.add_argument(
        "--peer-type",
        default="Q4_0",
        choices=("Q4_0", "Q4_1", "Q8_0"),
        help="the peers' GGUF: the published Q4_1 as it is or requantized by llama.cpp's quantizer (default "
        "Q4_0, the format llama.cpp has repacked x86 kernels for)",
    )
    p.add_argument(
        "--openvino-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an OpenVINO GenAI SchedulerConfig field (cache_size, max_num_seqs, max_num_batched_tokens, "
        "dynamic_split_fuse, enable_prefix_caching) or a CPU plugin property (KV_CACHE_PRECISION=u8), repeatable",
    )
    p.add_argument("--no-prefix", action="store_true", help="skip the prefix-caching comparison")
    p.add_argument(
        "--repeat-prompts",
        action="store_true",
        help="send the checked-in prompts as they are, so repeats hit prefix caches (default: each "
        "request starts with a line of its own and every prompt is computed in full)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=8,
        metavar="N",
        help="after the grid, N long prompts (400+ tokens) one at a time on engine, grpc and llama: "
        "prompt tokens/s (default 8, 0: skip; --quick: 0)",
    )
    p.add_argument("--prefix-max-tokens", type=int, default=4, help="new tokens per prefix-caching request (default 4)")
    p.add_argument(
        "--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="exported weights (default model_repository/text_generation/1)"
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="prompts JSON (default perf/data/generation_prompts.json)")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for a system to finish cancelled work after a window (default 60)",
    )
    p.add_argument(
        "--genai-perf",
        type=Path,
        metavar="EXE",
        help="also run NVIDIA's genai-perf (installed in its own venv: the path of its genai-perf script) "
        "against the served model over gRPC at the highest concurrency, one request per stream",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="only profile steps of the in-process engine (torch.profiler): decode-only at 1 stream and the "
        "highest concurrency, then the served workload's steady state (a closed loop over every prompt) "
        "at 16 and the highest: matrix products vs attention vs other ops vs Python outside the ops",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="only measure the text_generation stub's RSS per weights precision (each variant served in turn, "
        "or only --precision when it names one: once loaded, and after the highest concurrency's streams over the longest prompts)",
    )
    p.add_argument("--out-dir", type=Path, help="results folder (default perf/results/generate-<UTC time>)")
    p.add_argument(
        "--precision",
        default=os.environ.get("PRECISION", "auto"),
        help="the weights precision served, as `make serve PRECISION=...` (default auto: the best variant "
        "that passed its gate on this CPU; fp32, fp16_fp32, bf16, int4_bf16)",
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    q = args.quick
    if args.systems is None:
        args.systems = [k for k in SYSTEMS if k not in OPTIONAL_SYSTEMS]
    if q:
        args.prefill = 0
    for name, full, quick in (("concurrency", [1, 4, 16, 32], [1, 4]), ("max_tokens", 128, 16), ("duration", 30.0, 4.0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    if min(args.concurrency) < 1 or args.max_tokens < 1 or args.duration <= 0 or args.rounds < 1:
        p.error("--concurrency, --max-tokens, --duration and --rounds must be positive")
    if not (args.model_dir / "config.json").is_file():
        p.error(f"{args.model_dir} has no config.json: export the model first (python -m export.generation)")
    try:
        args.openvino_scheduler, args.openvino_plugin = split_openvino_config(args.openvino_config)
        args.config_name, args.weights_precision = resolve_precision(ROOT / "model_repository", args.precision)
    except ValueError as exc:
        p.error(str(exc))
    return args


def run_profile(args: argparse.Namespace, out_dir: Path) -> int:
    settings = served_engine_settings(ROOT / "model_repository", args.config_name)
    engine, loop = start_engine(args.model_dir, settings)
    loop.shutdown()  # the profile drives the engine itself
    workload = load_workload(args.data, engine.tokenizer, quick=False)
    short = [p for p in workload.prompts if len(p) < 1200]  # decode steps: the prompts' lengths hardly matter
    batch = max(args.concurrency)
    rows = []
    runs = [(b, False) for b in sorted({1, batch})] + [(b, True) for b in sorted({batch} if args.quick else {16, batch})]
    for b, steady in runs:
        steps = (5 if steady else 8) if args.quick else (30 if steady else 20)
        row = profile_step(
            engine, workload.prompts if steady else short, b, steps=steps, steady=steady, warm_steps=20 if args.quick else 150
        )
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    write_csv(out_dir / "profile.csv", rows)
    print(f"perf.bench.generate_bench --profile: {pa_display(out_dir / 'profile.csv')}", flush=True)
    return 0


async def _fill(system: System, prompts: Sequence[str], streams: int, max_tokens: int) -> int:
    records = [Stream(system.key, streams, i, time.perf_counter()) for i in range(streams)]
    await asyncio.gather(
        *(
            system.stream(f"request memory-{i}-{time.monotonic_ns()}\n" + prompts[i % len(prompts)], max_tokens, r)
            for i, r in enumerate(records)
        )
    )
    return sum(r.tokens for r in records)


async def _drive(system: System, prompts: Sequence[str], streams: int, max_tokens: int) -> int:
    await system.open()
    try:
        return await _fill(system, prompts, streams, max_tokens)
    finally:
        await system.close()


def run_memory(args: argparse.Namespace, out_dir: Path) -> int:
    """The text_generation stub's memory per weights precision: tritonserver serving each variant that
    passed its gate in turn, the stub's RSS once loaded, then its RSS and peak (VmHWM) after
    ``max(concurrency)`` gRPC streams of --max-tokens over the longest prompts (the KV pool is
    preallocated zeroed, so its pages count as they are written)."""
    from python_backends.generation.linear import PRECISIONS, kv_cache_dtype
    from python_backends.generation.llama_cpp_runtime import LLAMA_PRECISIONS, kv_bytes_per_block
    from python_backends.generation.model_runner import DTYPES, LlamaConfig
    from python_backends.generation.openvino_runtime import OV_PRECISIONS
    from python_backends.generation.paged_attention import bytes_per_block
    from server.stubs import find_stubs

    streams = max(args.concurrency)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    workload = load_workload(args.data, tokenizer, quick=False)
    prompts = [p for p, _ in sorted(workload.long_prompts, key=lambda pn: -pn[1])] or workload.prompts
    mcfg = LlamaConfig.from_folder(args.model_dir)
    rows = []
    every = (*PRECISIONS, *LLAMA_PRECISIONS, *OV_PRECISIONS)
    for precision in every if args.precision in ("auto", "cpu") else (args.precision,):
        try:
            config_name, served = resolve_precision(ROOT / "model_repository", precision)
        except ValueError as exc:  # not gated on this CPU: the reason is the row
            rows.append({"precision": precision, "note": f"not served here: {exc}"})
            print(f"{precision}: not served here: {exc}", flush=True)
            continue
        if served != precision:  # no config of its own here: it failed its gate or was not built
            rows.append({"precision": precision, "note": f"not served here: PRECISION={precision} serves {served}"})
            print(f"{precision}: not served here (no configs/{precision}.pbtxt)", flush=True)
            continue
        settings = served_engine_settings(ROOT / "model_repository", config_name)
        if served in LLAMA_PRECISIONS:  # llama.cpp's cache cells
            kv_dtype = settings.get("kv_cache_type", "f16")
            per_block = kv_bytes_per_block(mcfg, settings["block_size"], kv_dtype)
        elif served in OV_PRECISIONS:  # OpenVINO's paged cache, 2-byte elements
            kv_dtype = "bf16/f16"
            per_block = kv_bytes_per_block(mcfg, settings["block_size"], "f16")
        else:
            torch_dtype = kv_cache_dtype(served, DTYPES[settings.get("dtype", "float32")])
            per_block = bytes_per_block(mcfg.num_layers, settings["block_size"], mcfg.num_kv_heads, mcfg.head_dim, torch_dtype)
            kv_dtype = str(torch_dtype).removeprefix("torch.")
        blocks = settings["kv_cache_bytes"] // per_block
        workdir = Path(tempfile.mkdtemp(prefix=f"perf-generate-memory-{precision}-"))
        triton = start_triton(args.model_dir, workdir, config_name)
        try:
            triton.wait_ready(timeout=300)
            stubs = [st for st in find_stubs(triton.process.pid) if st.model == MODEL]
            if len(stubs) != 1:
                raise RuntimeError(f"expected one {MODEL} stub, found {stubs}")
            pid = stubs[0].pid
            loaded = processes.sample(pid)
            tokens = asyncio.run(_drive(GrpcSystem(triton.grpc_url), prompts, streams, args.max_tokens))
            after = processes.sample(pid)
            if loaded is None or after is None:
                raise RuntimeError(f"the {MODEL} stub (pid {pid}) is gone")
            row = {
                "precision": served,
                "kv_dtype": kv_dtype,
                "kv_pool_mib": round(blocks * per_block / 2**20),
                "kv_tokens": blocks * settings["block_size"],
                "rss_loaded_mib": round(loaded.rss_bytes / 2**20),
                "rss_after_mib": round(after.rss_bytes / 2**20),
                "rss_peak_mib": round(after.peak_rss_bytes / 2**20),
                "streams": streams,
                "tokens": tokens,
            }
        finally:
            triton.stop()
            shutil.rmtree(workdir, ignore_errors=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_csv(out_dir / "memory.csv", rows)
    print(f"perf.bench.generate_bench --memory: {pa_display(out_dir / 'memory.csv')}", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    from perf.baselines.naive_generate_server import NaiveGenerateServer
    from server.process import ServerError, free_port

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or DEFAULT_RESULTS / f"generate-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.profile:
        return run_profile(args, out_dir)
    if args.memory:
        return run_memory(args, out_dir)
    bench = Bench(args, out_dir)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    bench.say(
        f"perf.bench.generate_bench: {', '.join(args.systems)} at concurrency {args.concurrency}, "
        f"{args.max_tokens} tokens, {args.duration:g} s windows x {args.rounds} round(s), load average {load}"
    )
    from python_backends.generation.linear import describe_cpu

    bench.say(f"weights precision {args.weights_precision} (PRECISION={args.precision}), CPU: {describe_cpu()}")

    wanted = set(args.systems)
    workdir = Path(tempfile.mkdtemp(prefix="perf-generate-"))
    triton = naive = loop = nodraft_loop = genai = None
    systems: dict[str, System] = {}
    try:
        # The servers load while this process loads its own engine.
        if wanted & {"grpc", "http"}:
            triton = start_triton(args.model_dir, workdir, args.config_name)
            bench.say(f"tritonserver starting ({MODEL} only): http {triton.http_url}, grpc {triton.grpc_url}")
        if "naive" in wanted:
            naive = NaiveGenerateServer(free_port(), out_dir / "naive_server.log", model_dir=args.model_dir).start()
            bench.say(f"naive server starting on {naive.http_url}")
        settings = served_engine_settings(ROOT / "model_repository", args.config_name)
        engine, loop = start_engine(args.model_dir, settings)
        bench.say(f"engine loaded in-process: {settings or 'EngineConfig defaults'}")
        workload = load_workload(args.data, engine.tokenizer, args.quick)
        if "engine" in wanted:
            systems["engine"] = EngineSystem(loop)
        if "nodraft" in wanted:
            _, nodraft_loop = start_engine(args.model_dir, {**settings, "num_speculative_tokens": 0})
            systems["nodraft"] = EngineSystem(nodraft_loop, "nodraft")
        if naive is not None:
            try:
                naive.wait_ready()
                systems["naive"] = SseSystem(
                    "naive", naive.http_url, lambda: bool((st := naive.stats())["queued"] or st["running"])
                )
            except RuntimeError as exc:
                bench.say(f"naive server did not start: {exc}")
                bench.notes.append("naive server did not start")
        if wanted & set(PEERS):
            from perf.baselines import llama_cpp

            try:
                gguf = llama_cpp.model(args.peer_type, say=bench.say)
            except llama_cpp.LlamaCppError as exc:
                gguf = None
                bench.say(f"the peers' GGUF is unavailable: {exc}")
                bench.notes.append(f"peers unavailable: {str(exc)[:200]}")
        if "llama" in wanted and gguf is not None:
            try:
                binary = llama_cpp.server(say=bench.say)
                systems["llama"] = LlamaSystem(binary, gguf, out_dir / "llama_server.log")
                bench.say(f"llama-server: {pa_display(binary)} on {gguf.name}")
            except llama_cpp.LlamaCppError as exc:
                bench.say(f"llama-server unavailable: {exc}")
                bench.notes.append(f"llama-server unavailable: {str(exc)[:200]}")
        if "openvino" in wanted and gguf is not None:
            from perf.baselines.openvino_genai import Pipeline

            started = time.perf_counter()
            pipeline = Pipeline(gguf, os.cpu_count() or 1, args.openvino_scheduler, args.openvino_plugin)
            systems["openvino"] = OpenVinoSystem(pipeline, engine.tokenizer)
            bench.say(f"OpenVINO GenAI on {gguf.name} in {time.perf_counter() - started:.1f} s: {pipeline.settings}")
        if triton is not None:
            try:
                triton.wait_ready(timeout=300)
                probe = triton_busy(triton.metrics_url)
                if "grpc" in wanted:
                    systems["grpc"] = GrpcSystem(triton.grpc_url, probe)
                if "http" in wanted:
                    systems["http"] = SseSystem(
                        "http",
                        triton.http_url,
                        probe,
                        extra={"return_num_output_tokens": True, "return_finish_reason": True, "exclude_input_in_output": True},
                    )
            except ServerError as exc:
                bench.say(f"tritonserver did not start: {exc}\n{exc.log_tail}")
                bench.notes.append("tritonserver did not start")
        bench.say(f"{len(workload.prompts)} prompts; measuring {', '.join(systems)}")
        bench.run_grid(systems, workload)
        genai = None
        if args.genai_perf is not None and "grpc" in systems:
            assert triton is not None  # the grpc system is Triton's
            c = max(args.concurrency)
            bench.say(f"genai-perf at concurrency {c} ({args.genai_perf})")
            genai = run_genai_perf(
                args.genai_perf,
                triton.grpc_url,
                args.model_dir,
                out_dir,
                workload.prompts,
                c,
                args.max_tokens,
                requests=max(c, 4),
                timeout=max(120.0, 6 * args.duration),
            )
            bench.say(f"    {genai.get('error') or genai}")

        prefix_rows, prefix = [], None
        if not args.no_prefix:
            bench.say("prefix caching on / off (in-process engines, shared system prompt)")
            loop.shutdown()
            loop = None
            prefix_rows = measure_prefix(engine, workload, args.prefix_max_tokens, bench.say)
            prefix = prefix_summary(prefix_rows)
    finally:
        for engine_loop in (loop, nodraft_loop):
            if engine_loop is not None:
                engine_loop.shutdown()
        if naive is not None:
            naive.stop()
        if triton is not None:
            triton.stop()
            if triton.log_path.is_file():
                shutil.copyfile(triton.log_path, out_dir / "tritonserver.log")
        shutil.rmtree(workdir, ignore_errors=True)

    summaries = {k: c.summary() for k, c in bench.cells.items()}
    ordered = [summaries[(k, c)] for c in args.concurrency for k in SYSTEMS if (k, c) in summaries]
    prefill = prefill_summary(bench.prefill)
    ratio_rows = ratios(args, summaries, prefix, prefill)
    header = [
        f"# Text generation side by side: {MODEL} ({pa_display(args.model_dir)})",
        "",
        (f"- {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before measuring {load}"),
        f"- command: `{' '.join(['python -m perf.bench.generate_bench', *args.argv])}`",
        (
            f"- {len(workload.prompts)} prompts ({pa_display(args.data)}), chat template applied, {args.max_tokens} new "
            f"tokens each (ignore_eos), greedy; closed-loop clients, {args.duration:g} s window per system and "
            f"concurrency{f' after {args.warmup:g} s of warm-up' if args.warmup else ''}, {args.rounds} round(s), "
            f"systems interleaved"
        ),
        f"- engine settings (from config.pbtxt): {json.dumps(settings) if settings else 'defaults'}",
        *[f"- {n}" for n in bench.notes],
    ]
    for key in SYSTEMS:
        if key in systems:
            header.append(f"- {key}: {SYSTEM_NAMES[key]}")
    table = markdown(header, ordered, ratio_rows, prefix)
    if prefill:
        write_csv(out_dir / "prefill.csv", bench.prefill)
        table += (
            "\n| prefill: long prompts one at a time, 1 new token | prompts | prompt tokens/s P50 | TTFT P50 ms |\n"
            "| --- | ---: | ---: | ---: |\n"
            + "".join(
                f"| {r['system']} | {r['prompts']} | {_fmt(r['prompt_tokens_per_s_p50'])} | {_fmt(r['ttft_p50_ms'])} |\n"
                for r in prefill
            )
        )
    if genai is not None:
        write_csv(out_dir / "genai_perf.csv", [genai])
        ours = summaries.get(("grpc", genai["concurrency"]), {})
        table += (
            "\n| genai-perf (perf_analyzer, gRPC stream) | concurrency | tokens/s | TTFT P50 ms | TTFT P99 ms | "
            "ITL P50 ms | ITL P99 ms | this benchmark's grpc tokens/s |\n| --- | ---: | ---: | ---: | ---: | ---: | "
            "---: | ---: |\n"
            f"| {genai.get('error') or 'measured'} | {genai['concurrency']} | {_fmt(genai.get('tokens_per_s'))} | "
            f"{_fmt(genai.get('ttft_p50_ms'))} | {_fmt(genai.get('ttft_p99_ms'))} | {_fmt(genai.get('itl_p50_ms'))} | "
            f"{_fmt(genai.get('itl_p99_ms'))} | {_fmt(ours.get('tokens_per_s'))} |\n"
        )
    (out_dir / "summary.md").write_text(table)
    write_csv(out_dir / "cells.csv", ordered)
    write_csv(out_dir / "ratios.csv", ratio_rows)
    if prefix_rows:
        write_csv(out_dir / "prefix.csv", prefix_rows)
    requests = [
        {
            "system": s.system,
            "concurrency": s.concurrency,
            "prompt": s.prompt_index,
            "ttft_ms": round(1000 * (s.first - s.sent), 1) if s.first else None,
            "tokens": s.tokens,
            "finished": s.finished,
            "cancelled": s.cancelled,
            "error": s.error,
        }
        for c in bench.cells.values()
        for s in c.streams
    ]
    if requests:
        write_csv(out_dir / "requests.csv", requests)
    print("\n" + table, flush=True)
    bench.say(f"perf.bench.generate_bench: results in {pa_display(out_dir)}")
    ok = all(s["output_tokens"] > 0 for s in ordered) and len(ordered) == len(args.systems) * len(args.concurrency)
    return 0 if ok and (prefix is not None or args.no_prefix) else 1


def pa_display(path: Path) -> str:
    from perf.lib.perf_analyzer import display_path

    return display_path(path)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
