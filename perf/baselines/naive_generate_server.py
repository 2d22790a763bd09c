"""`python -m perf.baselines.naive_generate_server --port N`: the naive per-request baseline of
perf.bench.generate_bench.

The plain way to serve a causal LM: a FastAPI app under uvicorn that runs ``transformers``
``model.generate()`` for one request at a time on the same exported weights the served
``text_generation`` model loads (``AutoModelForCausalLM.from_pretrained(folder)``, FP32),
with no batching and no KV cache kept between requests.

It speaks Triton's generate extension, so the benchmark's HTTP client drives it exactly
like the served model: ``POST /v2/models/text_generation/generate_stream`` with
``{"text_input": "...", "parameters": {"max_tokens": 128, "temperature": 0, "ignore_eos": true}}``
answers Server-Sent Events (``data: {"text_output": "..."}``), ``/generate`` one JSON answer.
The prompt is used as given (the benchmark applies the chat template for every system).

Streaming: one event per generated token (its new text, possibly empty while a UTF-8
character is incomplete), so time to first token and inter-token latency are measured per
token as for the engine. ``TextIteratorStreamer`` is not used as is: it holds text back until
a word ends, so its chunks are words, not tokens.

Concurrency: requests queue for ONE worker thread (FIFO) that runs ``generate()`` on all
torch intra-op threads; the kindest naive server for a small CPU, since running several
``generate()`` calls at once only oversubscribes the cores. A client that disconnects stops
its generation at the next token (a stopping criterion) or, still queued, never starts.
``GET /stats`` reports queued, running and finished requests (the benchmark waits for idle).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from export.bench import cpu_threads
from perf.lib.paths import ROOT

log = logging.getLogger(__name__)

# The same OpenMP wait policy as the engine (python_backends/generation/__init__.py), so both
# sides of the comparison run PyTorch's threads alike; before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MODEL = "text_generation"
VERSION = "1"
DEFAULT_MODEL_DIR = ROOT / "model_repository" / MODEL / VERSION
MAX_TOKENS_LIMIT = 2048  # the engine's default max_tokens_limit
_DONE = object()


class RequestError(ValueError):
    """A malformed generate request: answered with HTTP 400 and this message."""


@dataclass
class GenerateRequest:
    prompt: str
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False


def parse_request(body: bytes) -> GenerateRequest:
    """The generate extension's JSON: ``text_input`` and sampling ``parameters`` (top level or nested)."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise RequestError("request body must be a JSON object")
    prompt = doc.get("text_input")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("'text_input' must be a non-empty string")
    params = dict(doc.get("parameters") or {})
    params.update({k: v for k, v in doc.items() if k not in ("text_input", "parameters", "stream")})
    known = {"max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"}
    if unknown := sorted(set(params) - known):
        raise RequestError(f"unknown parameters {unknown}; this server knows {sorted(known)}")
    req = GenerateRequest(prompt)
    try:
        req.max_tokens = int(params.get("max_tokens", req.max_tokens))
        req.temperature = float(params.get("temperature", req.temperature))
        req.top_p = float(params.get("top_p", req.top_p))
        req.top_k = int(params.get("top_k", req.top_k))
        req.seed = None if params.get("seed") is None else int(params["seed"])
        req.ignore_eos = bool(params.get("ignore_eos", False))
    except (TypeError, ValueError) as exc:
        raise RequestError(f"bad parameter value: {exc}") from None
    if not 1 <= req.max_tokens <= MAX_TOKENS_LIMIT:
        raise RequestError(f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {req.max_tokens}")
    if req.temperature < 0 or not 0 < req.top_p <= 1 or req.top_k < 0:
        raise RequestError("temperature must be >= 0, top_p in (0, 1], top_k >= 0")
    return req


@dataclass
class Counters:
    queued: int = 0
    running: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def as_json(self) -> dict[str, int]:
        with self.lock:
            return {k: getattr(self, k) for k in ("queued", "running", "finished", "cancelled", "failed", "tokens")}


class NaiveGenerator:
    """``transformers`` ``generate()`` on the exported weights, one call per request."""

    def __init__(self, model_dir: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.threads = threads
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos_token_id = self.model.generation_config.eos_token_id
        self.run(GenerateRequest("warm-up", max_tokens=2), lambda _id: None, threading.Event())

    def run(self, req: GenerateRequest, on_token, cancelled: threading.Event) -> int:
        """Generate for ``req``, calling ``on_token(id)`` per new token; stops early once
        ``cancelled`` is set. Returns the number of tokens generated."""
        from transformers import (
            GenerationConfig,
            StoppingCriteria,
            StoppingCriteriaList,
        )
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch

        class Streamer(BaseStreamer):
            def __init__(self):
                self.prompt_seen = False
                self.count = 0

            def put(self, value):
                if not self.prompt_seen:  # generate() first passes the prompt
                    self.prompt_seen = True
                    return
                for token in value.reshape(-1).tolist():
                    self.count += 1
                    on_token(token)

            def end(self):
                pass

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), cancelled.is_set(), dtype=torch.bool)

        config = GenerationConfig(
            max_new_tokens=req.max_tokens,
            min_new_tokens=req.max_tokens if req.ignore_eos else 0,
            do_sample=req.temperature > 0,
            temperature=req.temperature or 1.0,
            top_p=req.top_p,
            top_k=req.top_k or None,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.eos_token_id,
        )
        if req.seed is not None:
            torch.manual_seed(req.seed)
        ids = self.tokenizer(req.prompt, return_tensors="pt", add_special_tokens=False)
        streamer = Streamer()
        with torch.inference_mode():
            self.model.generate(
                **ids, generation_config=config, streamer=streamer, stopping_criteria=StoppingCriteriaList([Cancelled()])
            )
        return streamer.count


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def create_app(
    model_dir: Path = DEFAULT_MODEL_DIR, threads: int | None = None, generator: NaiveGenerator | None = None
) -> FastAPI:
    """The FastAPI app; loads the model before it returns."""
    generator = generator or NaiveGenerator(Path(model_dir), threads or cpu_threads())
    tokenizer = generator.tokenizer
    counters = Counters()
    # One worker, FIFO: generate() runs for one request after another (module docstring).
    worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
    app = FastAPI(title="naive text generation (transformers generate(), one request at a time)")
    app.state.generator = generator
    app.state.counters = counters

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    def check_model(name: str) -> JSONResponse | None:
        return None if name == MODEL else error(404, f"unknown model {name!r}; this server serves {MODEL!r}")

    @app.get("/v2/health/live")
    @app.get("/v2/health/ready")
    def health():
        return Response(status_code=200)

    @app.get("/v2/models/{name}/ready")
    def model_ready(name: str):
        return check_model(name) or Response(status_code=200)

    @app.get("/stats")
    def stats():
        return counters.as_json()

    async def tokens(req: GenerateRequest) -> AsyncIterator[int | BaseException]:
        """The request's new token ids as generate() makes them (an exception last if it failed)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def job() -> None:
            counters.add(queued=-1)
            if cancelled.is_set():
                counters.add(cancelled=1)
                return
            counters.add(running=1)
            try:
                n = generator.run(req, lambda t: loop.call_soon_threadsafe(queue.put_nowait, t), cancelled)
                counters.add(tokens=n, **({"cancelled": 1} if cancelled.is_set() else {"finished": 1}))
                loop.call_soon_threadsafe(queue.put_nowait, _DONE)
            except Exception as exc:  # the client gets the reason, the log the traceback
                log.exception("generate() failed")
                counters.add(failed=1)
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                counters.add(running=-1)

        counters.add(queued=1)
        worker.submit(job)
        try:
            while (item := await queue.get()) is not _DONE:
                yield item
                if isinstance(item, BaseException):
                    return
        finally:
            cancelled.set()  # a disconnected client (the stream was closed) stops its generation

    async def pieces(req: GenerateRequest) -> AsyncIterator[tuple[str, int] | BaseException]:
        """(new text, 1) per token: the decoded text's growth, an incomplete character held back."""
        ids: list[int] = []
        emitted = ""
        async for item in tokens(req):
            if isinstance(item, BaseException):
                yield item
                return
            ids.append(item)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            assert isinstance(text, str)  # one sequence of ids decodes to one string
            if text.endswith("\ufffd"):
                yield "", 1
                continue
            yield text[len(emitted) :], 1
            emitted = text

    async def read(request: Request) -> GenerateRequest:
        return parse_request(await request.body())

    @app.post("/v2/models/{name}/generate_stream")
    async def generate_stream(name: str, request: Request):
        if missing := check_model(name):
            return missing
        try:
            req = await read(request)
        except RequestError as exc:
            return error(400, str(exc))

        async def events() -> AsyncIterator[bytes]:
            async for item in pieces(req):
                if isinstance(item, BaseException):
                    yield _event({"error": f"generate() failed: {item}"})
                    return
                yield _event({"model_name": MODEL, "model_version": VERSION, "text_output": item[0]})

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v2/models/{name}/generate")
    async def generate(name: str, request: Request):
        if missing := check_model(name):
            return missing
        try:
            req = await read(request)
        except RequestError as exc:
            return error(400, str(exc))
        text, count = [], 0
        async for item in pieces(req):
            if isinstance(item, BaseException):
                return error(500, f"generate() failed: {item}")
            text.append(item[0])
            count += item[1]
        return {"model_name": MODEL, "model_version": VERSION, "text_output": "".join(text), "num_output_tokens": count}

    return app


class NaiveGenerateServer:
    """``python -m perf.baselines.naive_generate_server`` as a child process: ``start()``, ``wait_ready()``,
    ``stop()``, ``stats()``; the output goes to ``log_path``."""

    def __init__(
        self, port: int, log_path: Path, model_dir: Path = DEFAULT_MODEL_DIR, threads: int | None = None, host: str = "127.0.0.1"
    ):
        self.host, self.port, self.log_path = host, port, Path(log_path)
        self.model_dir = Path(model_dir)
        self.threads = threads or cpu_threads()
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> NaiveGenerateServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log_file:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "perf.baselines.naive_generate_server",
                    "--host",
                    self.host,
                    "--port",
                    str(self.port),
                    "--threads",
                    str(self.threads),
                    "--model-dir",
                    str(self.model_dir),
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                start_new_session=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Poll /v2/health/ready; raises RuntimeError (with the log's end) if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"naive generate server exited with code {code} before becoming ready\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"naive generate server not ready after {timeout:.0f} s\n{self.log_tail()}")

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"http://{self.http_url}/stats", timeout=5) as r:
            return json.loads(r.read())

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m perf.baselines.naive_generate_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="exported weights and tokenizer (default: model_repository/text_generation/1)",
    )
    p.add_argument("--threads", type=int, default=cpu_threads(), help="torch intra-op threads (default: this process's CPUs)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (info logs every request)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    if not (args.model_dir / "config.json").is_file():
        p.error(f"{args.model_dir} has no config.json: export the model first (python -m export.generation)")

    import uvicorn

    app = create_app(args.model_dir, threads=args.threads)
    log.info(
        "naive generate server: %s on %d threads, http://%s:%d/v2/models/%s/generate_stream",
        args.model_dir,
        args.threads,
        args.host,
        args.port,
        MODEL,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.log_level == "info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
