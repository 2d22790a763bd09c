"""`python -m perf.baselines.naive_generate_server --port N`: the naive baseline of perf.bench.generate_bench.

The plain way to serve a causal LM: ``transformers`` ``generate()`` for one request at a time (one
worker thread, FIFO, every torch thread: several calls at once only oversubscribe a small CPU)
behind FastAPI, on the weights ``text_generation`` loads (FP32), no batching, no KV cache kept.
``POST /v2/models/text_generation/generate_stream`` takes Triton's generate extension as the
project's client sends it (``text_input``; ``max_tokens``, ``temperature``, ``ignore_eos`` in
``sampling_parameters``) and answers one Server-Sent Event per token (its new text and the running
``num_output_tokens``; ``TextIteratorStreamer`` would hold text back to a word's end), then one with
the ``finish_reason``. A client that disconnects stops its generation at the next token or, still
queued, never starts. ``GET /stats``: the queued and running requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from export.bench import cpu_threads
from perf.lib import options
from perf.lib.paths import ROOT
from server.supervisor import ChildProcess, NotReady, http_status

log = logging.getLogger(__name__)

# The same OpenMP wait policy as the engine (python_backends/generation/__init__.py), so both
# sides of the comparison run PyTorch's threads alike; before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MODEL = "text_generation"
DEFAULT_MODEL_DIR = ROOT / "model_repository" / MODEL / "1"
MAX_TOKENS_LIMIT = 2048  # the engine's default max_tokens_limit
KNOWN = ("max_tokens", "temperature", "ignore_eos")


class RequestError(ValueError):
    """A malformed generate request: answered with HTTP 400 and this message."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    max_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False


def parse_request(body: bytes) -> GenerateRequest:
    """``text_input`` and the sampling fields of a generate request's JSON body."""
    try:
        doc = json.loads(body)
        params = dict(json.loads(doc.get("sampling_parameters") or "{}"))
    except (ValueError, AttributeError, TypeError) as exc:
        raise RequestError(f"the body must be a JSON object, its sampling_parameters JSON: {exc}") from None
    if unknown := sorted(set(params) - set(KNOWN)):
        raise RequestError(f"unknown parameters {unknown}; this server knows {list(KNOWN)}")
    prompt = doc.get("text_input")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("'text_input' must be a non-empty string")
    try:
        max_tokens, temperature = int(params.get("max_tokens", 16)), float(params.get("temperature", 0.0))
    except (TypeError, ValueError) as exc:
        raise RequestError(f"bad parameter value: {exc}") from None
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT or temperature < 0:
        raise RequestError(f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}] and temperature >= 0")
    return GenerateRequest(prompt, max_tokens, temperature, bool(params.get("ignore_eos", False)))


class NaiveGenerator:
    """``transformers`` ``generate()`` on the exported weights, one call per request."""

    def __init__(self, model_dir: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.run(GenerateRequest("warm-up", max_tokens=2), lambda _id: None, threading.Event())

    def run(self, req: GenerateRequest, on_token, cancelled: threading.Event) -> None:
        """Generate for ``req``, calling ``on_token(id)`` per new token; stops at the next token once
        ``cancelled`` is set."""
        import torch
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        class Streamer(BaseStreamer):
            prompt_seen = False  # generate() first passes the prompt

            def put(self, value):
                if self.prompt_seen:
                    for token in value.reshape(-1).tolist():
                        on_token(token)
                self.prompt_seen = True

            def end(self):
                pass

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), cancelled.is_set(), dtype=torch.bool)

        eos = self.model.generation_config.eos_token_id
        config = GenerationConfig(
            max_new_tokens=req.max_tokens,
            min_new_tokens=req.max_tokens if req.ignore_eos else 0,
            do_sample=req.temperature > 0,
            temperature=req.temperature or 1.0,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        ids = self.tokenizer(req.prompt, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            self.model.generate(
                **ids, generation_config=config, streamer=Streamer(), stopping_criteria=StoppingCriteriaList([Cancelled()])
            )


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps({'model_name': MODEL, **payload}, ensure_ascii=False)}\n\n".encode()


def create_app(model_dir: Path = DEFAULT_MODEL_DIR, threads: int | None = None) -> FastAPI:
    """The FastAPI app; loads the model before it returns."""
    generator = NaiveGenerator(Path(model_dir), threads or cpu_threads())
    counts = {"queued": 0, "running": 0}
    lock = threading.Lock()
    worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")  # one at a time, FIFO
    app = FastAPI(title="naive text generation (transformers generate(), one request at a time)")

    def count(key: str, delta: int) -> None:
        with lock:
            counts[key] += delta

    @app.get("/v2/health/live")
    @app.get("/v2/health/ready")
    def health():
        return Response(status_code=200)

    @app.get("/stats")
    def stats():
        with lock:
            return dict(counts)

    async def events(req: GenerateRequest) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | Exception | None] = asyncio.Queue()
        cancelled = threading.Event()

        def job() -> None:
            count("queued", -1)
            if cancelled.is_set():
                return
            count("running", 1)
            try:
                generator.run(req, lambda t: loop.call_soon_threadsafe(queue.put_nowait, t), cancelled)
                loop.call_soon_threadsafe(queue.put_nowait, None)
            except Exception as exc:  # the client gets the reason, the log the traceback
                log.exception("generate() failed")
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                count("running", -1)

        count("queued", 1)
        worker.submit(job)
        ids: list[int] = []
        text = ""
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    yield _event({"error": f"generate() failed: {item}"})
                    return
                ids.append(item)
                decoded = generator.tokenizer.decode(ids, skip_special_tokens=True)
                assert isinstance(decoded, str)  # one sequence of ids decodes to one string
                piece = "" if decoded.endswith("\ufffd") else decoded[len(text) :]
                text += piece
                yield _event({"text_output": piece, "num_output_tokens": len(ids)})
            reason = "length" if len(ids) >= req.max_tokens else "stop"
            yield _event({"text_output": "", "num_output_tokens": len(ids), "finish_reason": reason})
        finally:
            cancelled.set()  # a disconnected client (the stream was closed) stops its generation

    @app.post("/v2/models/{name}/generate_stream")
    async def generate_stream(name: str, request: Request):
        if name != MODEL:
            return JSONResponse({"error": f"unknown model {name!r}; this server serves {MODEL!r}"}, status_code=404)
        try:
            req = parse_request(await request.body())
        except RequestError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return StreamingResponse(events(req), media_type="text/event-stream")

    return app


class NaiveGenerateServer:
    """The server as a child process: ``start()``, ``wait_ready()``, ``busy()``, ``stop()``; its output
    goes to ``log_path``."""

    def __init__(self, port: int, log_path: Path, model_dir: Path = DEFAULT_MODEL_DIR, threads: int | None = None):
        self.http_url = f"127.0.0.1:{port}"
        self.child = ChildProcess("naive generate server", log_path, log_mode="w", grace=15)
        self.args = ["--port", str(port), "--threads", str(threads or cpu_threads()), "--model-dir", str(model_dir)]

    def start(self) -> NaiveGenerateServer:
        command = [sys.executable, "-m", "perf.baselines.naive_generate_server", *self.args]
        self.child.start(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=ROOT)
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until /v2/health/ready answers; RuntimeError (with the log's end) if it exits or times out."""
        try:
            self.child.wait_ready(lambda: http_status(f"http://{self.http_url}/v2/health/ready") == 200, timeout)
        except NotReady as exc:
            raise RuntimeError(f"naive generate server: {exc}\n{self.child.log_tail(40)}") from None

    def busy(self) -> bool:
        with urllib.request.urlopen(f"http://{self.http_url}/stats", timeout=5) as r:
            stats = json.loads(r.read())
        return bool(stats["queued"] or stats["running"])

    def stop(self) -> None:
        self.child.stop(kill_group=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = options.parser("perf.baselines.naive_generate_server", __doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="exported weights and tokenizer")
    p.add_argument("--threads", type=int, default=cpu_threads(), help="torch intra-op threads (default: this process's CPUs)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (info logs every request)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    if not (args.model_dir / "config.json").is_file():
        p.error(f"{args.model_dir} has no config.json: export the model first (python -m export.generation)")

    import uvicorn

    app = create_app(args.model_dir, threads=args.threads)
    log.info("naive generate server: %s on %d threads, http://%s:%d", args.model_dir, args.threads, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.log_level == "info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
