"""The systems a generation benchmark streams from, and how each is started: the engine in process,
Triton's text_generation through the project's client transport, the OpenAI gateway's chat
completions, llama.cpp's llama-server and OpenVINO GenAI (the peers); the served
precision and engine settings, engines that share one set of weights, tritonserver with
text_generation alone."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from perf.lib import triton_stats
from perf.lib.generation_load import Stream, System
from perf.lib.paths import ROOT
from server.supervisor import ChildProcess, NotReady, free_port, http_status

MODEL = "text_generation"
DEFAULT_MODEL_DIR = ROOT / "model_repository" / MODEL / "1"
PEERS = ("llama", "openvino")


async def _until_done(submit: Callable[[Callable[[Any], None]], Any], cancel: Callable[[Any], None]) -> None:
    """Await a request another thread runs: ``submit(done)`` starts it and returns its handle, the
    thread calls ``done(error or None)`` at its end; a cancelled wait calls ``cancel(handle)``."""
    aio = asyncio.get_running_loop()
    future = aio.create_future()

    def done(error) -> None:
        def finish() -> None:
            if not future.done():
                future.set_result(error)

        aio.call_soon_threadsafe(finish)

    handle = submit(done)
    try:
        error = await future
    except asyncio.CancelledError:
        cancel(handle)
        raise
    if error is not None:
        raise RuntimeError(str(error))


class EngineSystem(System):
    """The engine in this process: requests go in through its EngineLoop's queue."""

    key = "engine"

    def __init__(self, loop):
        self.loop = loop  # python_backends.generation.engine_loop.EngineLoop
        self._ids = itertools.count()

    async def stream(self, prompt: str, max_tokens: int, record: Stream) -> None:
        from python_backends.generation.sampling import SamplingParams

        rid = f"bench-{next(self._ids)}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        def submit(done) -> None:
            def on_output(out) -> None:  # the engine's loop thread: stamp now
                record.add(len(out.token_ids))
                if out.finished:
                    done(out.error)

            self.loop.submit(rid, prompt, params, on_output)

        await _until_done(submit, lambda _: self.loop.abort(rid))

    def busy(self) -> bool:
        stats = self.loop.stats()
        return bool(stats.get("num_requests_running") or stats.get("num_requests_waiting") or self.loop.engine.has_unfinished())


class TritonSystem(System):
    """text_generation through the project's client transport (clients/generation): a gRPC stream
    (``protocol`` grpc) or HTTP SSE ``generate_stream``."""

    def __init__(self, key: str, url: str, protocol: str, busy: Callable[[], bool | None] = lambda: None):
        self.key, self.url, self.protocol, self._busy = key, url, protocol, busy
        self.connection: Any = None

    async def open(self) -> None:
        from clients.generation.request import GenerationOptions
        from clients.transport import triton_client

        self.options = GenerationOptions.create(self.url, protocol=self.protocol, timeout_s=600)
        if self.protocol == "grpc":
            self.connection = triton_client("grpc", self.url, aio=True)
        else:
            import aiohttp

            self.connection = aiohttp.ClientSession(f"http://{self.url}", connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()

    async def stream(self, prompt: str, max_tokens: int, record: Stream) -> None:
        from clients.generation.grpc_transport import grpc_aio_stream
        from clients.generation.http_transport import http_aio_stream
        from clients.generation.request import GenerateRequest

        request = GenerateRequest.prompt(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        transport = grpc_aio_stream if self.protocol == "grpc" else http_aio_stream
        pieces, cancel = transport(self.options, self.connection, request, True)
        seen = 0
        try:
            async for piece in pieces:
                if piece.num_output_tokens is not None:  # cumulative; an empty final response has none
                    record.add(piece.num_output_tokens - seen)
                    seen = piece.num_output_tokens
        finally:
            await cancel()  # ends the call (and the request, if it still runs)
            await pieces.aclose()

    def busy(self) -> bool | None:
        return self._busy()


class GatewaySystem(System):
    """The OpenAI gateway's streamed ``/v1/chat/completions`` in front of Triton's text_generation
    (perf.lib.chat_streams.GatewayChat), tokens stamped with the chunk that carries them. The gateway
    applies the chat template itself, so the message is the prompt's own text (``texts``: templated
    prompt -> text), after the line that leads each request."""

    key = "gateway"

    def __init__(self, url: str, api_key: str, texts: dict[str, str], busy: Callable[[], bool | None] = lambda: None):
        self.url, self.api_key, self.texts, self._busy = url, api_key, texts, busy
        self.session: Any = None

    async def open(self) -> None:
        import aiohttp

        from perf.lib.chat_streams import GatewayChat

        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        self.chat = GatewayChat(self.session, self.url, self.api_key)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def stream(self, prompt: str, max_tokens: int, record: Stream) -> None:
        if prompt in self.texts:  # the warm-up's, without a leading line
            message = self.texts[prompt]
        else:
            label, _, templated = prompt.partition("\n")
            message = f"{label}\n{self.texts[templated]}"
        await self.chat.stream(message, max_tokens, on_tokens=record.add)

    def busy(self) -> bool | None:
        return self._busy()


class LlamaSystem(System):
    """llama.cpp's llama-server on the peers' GGUF, restarted with ``--parallel`` equal to each window's
    concurrency and ``--cont-batching``; its native ``/completion`` stream (one event per token) of the
    prompt as the benchmark templated it."""

    key = "llama"
    CONTEXT_PER_SLOT = 2048  # tokens of KV per parallel slot: the longest prompt plus max_tokens

    def __init__(self, binary: Path, model: Path, log_path: Path):
        self.binary, self.model = binary, model
        self.child = ChildProcess("llama-server", log_path, grace=10)
        self.parallel = 0
        self.url = ""
        self.session: Any = None

    async def open(self) -> None:
        import aiohttp

        # A fresh connection per stream: llama-server closes a kept-alive one after a stream, and a
        # request written onto it then fails ("Can not write request body").
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_read=600), connector=aiohttp.TCPConnector(limit=0, force_close=True)
        )

    async def prepare(self, concurrency: int) -> None:
        if self.child.running() and self.parallel == concurrency:
            return
        self.child.stop()
        port = free_port()
        self.parallel, self.url = concurrency, f"127.0.0.1:{port}"
        self.child.start(
            [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(concurrency)]
            + ["--cont-batching", "-t", str(os.cpu_count() or 1), "-c", str(self.CONTEXT_PER_SLOT * concurrency)]
            + ["--no-webui", "--slots"]
        )
        try:
            await asyncio.to_thread(self.child.wait_ready, lambda: http_status(f"http://{self.url}/health") == 200, 120)
        except NotReady as exc:
            raise RuntimeError(f"llama-server {exc} (log {self.child.log_path})") from None

    async def stream(self, prompt: str, max_tokens: int, record: Stream) -> None:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        seen = 0
        async with self.session.post(f"http://{self.url}/completion", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                if event.get("stop"):
                    predicted = int(event.get("tokens_predicted") or seen)
                    if predicted > seen:
                        record.add(predicted - seen, now)
                    return
                seen += 1
                record.add(1, now)

    def busy(self) -> bool | None:
        """Whether a slot still works (llama-server's /slots): a cancelled stream's slot must be free
        before the next window, or llama.cpp would take cores from the next system."""
        try:
            with urllib.request.urlopen(f"http://{self.url}/slots", timeout=5) as r:
                return any(slot.get("is_processing") for slot in json.loads(r.read()))
        except TimeoutError:
            return True  # too busy to answer
        except urllib.error.URLError as exc:
            return True if isinstance(exc.reason, TimeoutError) else None
        except (OSError, ValueError):
            return None

    async def close(self) -> None:
        self.child.stop()
        if self.session is not None:
            await self.session.close()


class OpenVinoSystem(System):
    """OpenVINO GenAI's ContinuousBatchingPipeline in this process (perf/baselines/openvino_genai.py) on
    the peers' GGUF, fed the benchmark's templated prompt as token ids."""

    key = "openvino"

    def __init__(self, pipeline, tokenizer):
        self.pipeline, self.tokenizer = pipeline, tokenizer

    async def stream(self, prompt: str, max_tokens: int, record: Stream) -> None:
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        await _until_done(lambda done: self.pipeline.submit(ids, max_tokens, record.add, done), self.pipeline.cancel)

    def busy(self) -> bool:
        return self.pipeline.busy()

    async def close(self) -> None:
        self.pipeline.close()


def served_gauges(metrics_url: str) -> dict[str, float]:
    """The served model's series on tritonserver's metrics port, by name (llm_num_requests_running, ...)."""
    series = triton_stats.metrics(metrics_url, timeout=5).items()
    return {key.partition("{")[0]: value for key, value in series if f'model="{MODEL}"' in key}


def triton_busy(metrics_url: str) -> Callable[[], bool | None]:
    """A probe of the served model's running and waiting gauges (None: not there)."""

    def probe() -> bool | None:
        try:
            gauges = served_gauges(metrics_url)
        except OSError:
            return None
        values = [gauges[k] for k in ("llm_num_requests_running", "llm_num_requests_waiting") if k in gauges]
        return any(v > 0 for v in values) if values else None

    return probe


def resolve_precision(repository: Path, precision: str) -> tuple[str | None, str]:
    """(Triton's --model-config-name, the weights precision served) for PRECISION (export/variants.py)."""
    from export import variants

    config_name, served = variants.resolve_precision(repository, [MODEL], precision, gpu=False)
    return config_name, served[MODEL]


def served_engine_settings(repository: Path, config_name: str | None = None) -> dict:
    """EngineConfig keyword arguments from the parameters of the config Triton serves
    (``configs/<config_name>.pbtxt`` when it exists, else config.pbtxt)."""
    from contract.model_config import ModelConfig
    from ops.configs import config_from_disk
    from python_backends.generation.serving import engine_settings

    if not (repository / MODEL / "config.pbtxt").is_file():
        return {}
    cfg = ModelConfig(config_from_disk(repository, MODEL, config_name))
    settings = engine_settings(cfg.param, cfg.param_int, cfg.param_bool)
    if settings["dtype"] == "auto":  # what the served model picks on a CPU instance
        settings["dtype"] = "float32"
    return settings


def start_engine(settings: dict, model_dir: Path = DEFAULT_MODEL_DIR):
    """An LLMEngine on the CPU with ``settings`` (EngineConfig's fields)."""
    from python_backends.generation.engine import LLMEngine
    from python_backends.generation.engine_config import EngineConfig

    return LLMEngine(EngineConfig(model_dir=str(model_dir), device="cpu", **settings))


def engine_variant(engine, **changes):
    """An engine sharing ``engine``'s weights and tokenizer, its config changed as ``changes`` say."""
    from python_backends.generation.engine import LLMEngine

    return LLMEngine(dataclasses.replace(engine.config, **changes), weights=engine.weights, tokenizer=engine.tokenizer)


def run_together(engine, prompts: Sequence[str], params, tag: str) -> dict[str, Any]:
    """``prompts`` added to ``engine`` at once and stepped to the end in this thread: per request its
    output ids and (arrival, tokens) of each step's output, the start and the wall time, and how much
    each of the engine's counters grew (steps, prompt_tokens_computed, spec_draft_tokens, ...)."""
    before = collections.Counter(engine.counters)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    arrivals: dict[str, list[tuple[float, int]]] = {rid: [] for rid in ids}
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.token_ids:
                tokens[out.request_id].extend(out.token_ids)
                arrivals[out.request_id].append((now, len(out.token_ids)))
    wall = time.perf_counter() - start
    grown = collections.Counter(engine.counters)
    grown.subtract(before)
    return {
        "tokens": [tokens[r] for r in ids],
        "arrivals": [arrivals[r] for r in ids],
        "start": start,
        "wall": wall,
        "counters": grown,
    }


def start_triton(workdir: Path, config_name: str | None = None):
    """tritonserver with only text_generation (the launcher's code path, front door included), started
    (a server.deployment.Deployment: wait_ready(), then stop(logs_to=))."""
    from perf.lib.deployment import server_deployment

    return server_deployment((MODEL,), workdir, model_config_name=config_name).start()
