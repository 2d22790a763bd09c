"""The systems a generation benchmark streams from: the engine in process, Triton over HTTP SSE
and gRPC, llama.cpp's llama-server and OpenVINO GenAI (the peers), with how each is started:
the served precision and engine settings, the in-process engine, tritonserver with text_generation."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from perf.lib.paths import ROOT

if TYPE_CHECKING:  # imported where they are used: the in-process systems need neither
    import subprocess

    import aiohttp
    import tritonclient.grpc.aio as grpcclient

from perf.lib.generation_load import Stream, System

log = logging.getLogger(__name__)

MODEL = "text_generation"
DEFAULT_MODEL_DIR = ROOT / "model_repository" / MODEL / "1"
PEERS = ("llama", "openvino")


def _params(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


class EngineSystem(System):
    def __init__(self, loop, key: str = "engine"):
        self.key = key
        self.loop = loop  # python_backends.generation.engine_loop.EngineLoop
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


# --------------------------------------------------------------------------- set-up


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

    path = repository / MODEL / "config.pbtxt"
    if not path.is_file():
        return {}
    cfg = ModelConfig(config_from_disk(repository, MODEL, config_name))
    settings = engine_settings(cfg.param, cfg.param_int, cfg.param_bool)
    if settings["dtype"] == "auto":  # what the served model picks on a CPU instance
        settings["dtype"] = "float32"
    return settings


def start_engine(model_dir: Path, settings: dict):
    from python_backends.generation.engine import EngineConfig, LLMEngine
    from python_backends.generation.engine_loop import EngineLoop

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), device="cpu", **settings))
    return engine, EngineLoop(engine)


def start_triton(model_dir: Path, workdir: Path, config_name: str | None = None):
    """tritonserver with only text_generation (the launcher's code path, front door included).

    With --model-dir elsewhere than the version folder, a temporary repository holds the
    model's config.pbtxt and model.py with links to those weights."""
    from perf.lib.deployment import server_deployment

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
    server = server_deployment((MODEL,), workdir, model_repository=repository, model_config_name=config_name).triton
    return server.start()
