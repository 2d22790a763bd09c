"""`python -m perf.baselines.naive_server --port N`: the naive per-request baseline of perf.bench.compare.

The seed articles' "original implementation": a FastAPI app under uvicorn that runs the
PyTorch all-MiniLM-L6-v2 (transformers' tokenizer, the BertModel, masked mean pooling, L2
norm; export/reference.py) once per request, without batching, FP32.

It speaks just enough of the KServe v2 HTTP protocol that the SAME load generator
(perf_analyzer over HTTP, plain Triton service kind) drives it exactly like Triton's
``text_embedding``: server and model health, model metadata and config (perf_analyzer reads
both before sending anything), ``POST /v2/models/text_embedding/infer`` with JSON or
binary-tensor bodies (perf_analyzer's HTTP client sends inputs and asks for outputs in the
binary extension), and the statistics extension (perf_analyzer reads it at each window's
start and end; here it also gives the server-side queue / tokenize / model / pool split).

Concurrency: the event loop parses requests while ONE worker thread runs the model, one
request after another; the time a request waits for that thread is its queue time. That is
the kindest naive server for a small CPU: torch already uses the same intra-op threads as
ONNX Runtime gets (2 here), and running several requests' models at once would only
oversubscribe the cores. So the served/naive ratio is not inflated by a strawman.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from contract.errors import InputError
from export.bench import cpu_threads
from perf.lib.paths import ROOT
from python_backends.text.tokenization import decode_texts

log = logging.getLogger(__name__)

MODEL = "text_embedding"
VERSION = "1"
INPUT = "TEXT"
OUTPUT = "EMBEDDING"
HIDDEN = 384
MAX_BATCH = 64  # texts per request; the same limit as the served ensemble's max_batch_size
MAX_TEXT_BYTES = 65536  # the served tokenizer's max_text_bytes
HEADER_LENGTH = "Inference-Header-Content-Length"  # KServe v2 binary tensor data extension

# The served ensemble's interface, so that perf_analyzer shapes its requests identically.
CONFIG: dict[str, Any] = {
    "name": MODEL,
    "platform": "",
    "backend": "fastapi_pytorch",
    "version_policy": {"latest": {"num_versions": 1}},
    "max_batch_size": MAX_BATCH,
    "input": [
        {
            "name": INPUT,
            "data_type": "TYPE_STRING",
            "format": "FORMAT_NONE",
            "dims": [1],
            "is_shape_tensor": False,
            "allow_ragged_batch": False,
            "optional": False,
        }
    ],
    "output": [{"name": OUTPUT, "data_type": "TYPE_FP32", "dims": [HIDDEN], "label_filename": "", "is_shape_tensor": False}],
    "instance_group": [{"name": MODEL, "kind": "KIND_CPU", "count": 1}],
    "model_transaction_policy": {"decoupled": False},
    "parameters": {},
}
METADATA: dict[str, Any] = {
    "name": MODEL,
    "versions": [VERSION],
    "platform": "fastapi_pytorch",
    "inputs": [{"name": INPUT, "datatype": "BYTES", "shape": [-1, 1]}],
    "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, HIDDEN]}],
}


class RequestError(ValueError):
    """A malformed inference request: answered with HTTP 400 and this message."""


# --------------------------------------------------------------------------- the model


class TorchEmbedder:
    """PyTorch all-MiniLM-L6-v2, one call per request: tokenize, encode, pool (export/reference.py)."""

    def __init__(self, threads: int):
        import torch

        from export import reference

        torch.set_num_threads(threads)
        self.threads = threads
        self._reference = reference
        reference.load_torch_model()
        reference.load_hf_tokenizer()
        self.embed(["warm-up"])  # the first call allocates; keep it out of the measurements

    def tokenize(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        return self._reference.tokenize(texts)

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self._reference.token_embeddings(input_ids, attention_mask)

    @staticmethod
    def pool(hidden: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        m = attention_mask[..., None].astype(np.float32)
        pooled = (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        return (pooled / np.linalg.norm(pooled, axis=1, keepdims=True)).astype(np.float32)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        ids, mask = self.tokenize(texts)
        return self.pool(self.encode(ids, mask), mask)


# --------------------------------------------------------------------------- statistics


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += ns


@dataclass
class Statistics:
    """Cumulative figures in the KServe/Triton statistics extension's JSON shape."""

    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    parts: dict[str, _Duration] = field(
        default_factory=lambda: {
            k: _Duration()
            for k in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")
        }
    )
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_success(self, n: int, total_ns: int, queue_ns: int, input_ns: int, infer_ns: int, output_ns: int):
        with self.lock:
            self.inference_count += n
            self.execution_count += 1
            self.last_inference_ms = int(time.time() * 1000)
            for key, ns in (
                ("success", total_ns),
                ("queue", queue_ns),
                ("compute_input", input_ns),
                ("compute_infer", infer_ns),
                ("compute_output", output_ns),
            ):
                self.parts[key].add(ns)

    def record_failure(self, total_ns: int) -> None:
        with self.lock:
            self.parts["fail"].add(total_ns)

    def as_json(self) -> dict[str, Any]:
        with self.lock:
            return {
                "model_stats": [
                    {
                        "name": MODEL,
                        "version": VERSION,
                        "last_inference": self.last_inference_ms,
                        "inference_count": self.inference_count,
                        "execution_count": self.execution_count,
                        "inference_stats": {k: {"count": d.count, "ns": d.ns} for k, d in self.parts.items()},
                        "response_stats": {},
                        "batch_stats": [],
                        "memory_usage": [],
                    }
                ]
            }


# --------------------------------------------------------------------------- the protocol


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        out: list[Any] = []
        for item in data:
            out.extend(_flatten(item))
        return out
    return [data]


def _split_bytes(blob: bytes, field_name: str) -> list[bytes]:
    """BYTES tensor in the binary extension: each element is a 4-byte little-endian length, then the bytes."""
    items, offset = [], 0
    while offset < len(blob):
        if offset + 4 > len(blob):
            raise RequestError(f"{field_name}: truncated BYTES element length at offset {offset}")
        (length,) = struct.unpack_from("<I", blob, offset)
        offset += 4
        if offset + length > len(blob):
            raise RequestError(f"{field_name}: BYTES element of {length} bytes runs past the end of the data")
        items.append(blob[offset : offset + length])
        offset += length
    return items


@dataclass
class InferRequest:
    texts: list[str]
    request_id: str | None
    binary_output: bool


def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """Validate one KServe v2 inference request (JSON, or JSON header + binary tensors)."""
    if header_length is not None:
        try:
            json_length = int(header_length)
        except ValueError:
            raise RequestError(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 < json_length <= len(body):
            raise RequestError(f"{HEADER_LENGTH}={json_length} does not fit a body of {len(body)} bytes")
        header_bytes, binary = body[:json_length], body[json_length:]
    else:
        header_bytes, binary = body, b""
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise RequestError("request body must be a JSON object")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError("request needs a non-empty 'inputs' list")

    text_input = None
    offset = 0
    for tensor in inputs:
        if not isinstance(tensor, dict):
            raise RequestError("each entry of 'inputs' must be an object")
        params = tensor.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        chunk = None
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise RequestError(f"input {tensor.get('name')!r}: binary_data_size {size!r} does not fit the binary data")
            chunk, offset = binary[offset : offset + size], offset + size
        if tensor.get("name") == INPUT:
            text_input = (tensor, chunk)
        else:
            raise RequestError(f"unexpected input {tensor.get('name')!r}; model {MODEL} has one input, {INPUT!r}")
    if text_input is None:
        raise RequestError(f"input {INPUT!r} is missing")
    tensor, chunk = text_input

    if tensor.get("datatype") != "BYTES":
        raise RequestError(f"input {INPUT!r} must have datatype BYTES, got {tensor.get('datatype')!r}")
    shape = tensor.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) for d in shape) and shape[1] == 1):
        raise RequestError(f"input {INPUT!r} must have shape [n, 1], got {shape!r}")
    n = shape[0]
    if not 1 <= n <= MAX_BATCH:
        raise RequestError(f"input {INPUT!r}: batch of {n} texts; between 1 and {MAX_BATCH} allowed")
    if chunk is not None:
        values: list[Any] = _split_bytes(chunk, INPUT)
    elif "data" in tensor:
        values = _flatten(tensor["data"])
    else:
        raise RequestError(f"input {INPUT!r} has neither 'data' nor binary_data_size")
    if len(values) != n:
        raise RequestError(f"input {INPUT!r}: shape {shape} needs {n} elements, got {len(values)}")
    if not all(isinstance(v, (str, bytes)) for v in values):
        raise RequestError(f"input {INPUT!r}: BYTES data must be strings")
    try:
        texts = decode_texts(np.array(values, dtype=object), INPUT, MAX_TEXT_BYTES)
    except InputError as exc:
        raise RequestError(str(exc)) from None

    outputs = header.get("outputs") or []
    if not isinstance(outputs, list):
        raise RequestError("'outputs' must be a list")
    binary_output = bool((header.get("parameters") or {}).get("binary_data_output", False))
    for out in outputs:
        if not isinstance(out, dict) or out.get("name") != OUTPUT:
            raise RequestError(f"unknown output {out.get('name') if isinstance(out, dict) else out!r}; only {OUTPUT!r}")
        binary_output = bool((out.get("parameters") or {}).get("binary_data", binary_output))
    request_id = header.get("id")
    return InferRequest(texts, None if request_id is None else str(request_id), binary_output)


def response_body(request: InferRequest, embeddings: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """The inference response: JSON with data, or a JSON header followed by the raw FP32 tensor."""
    output: dict[str, Any] = {"name": OUTPUT, "datatype": "FP32", "shape": list(embeddings.shape)}
    header: dict[str, Any] = {"model_name": MODEL, "model_version": VERSION, "outputs": [output]}
    if request.request_id is not None:
        header["id"] = request.request_id
    if not request.binary_output:
        output["data"] = embeddings.reshape(-1).tolist()
        return json.dumps(header).encode(), {"content-type": "application/json"}
    raw = np.ascontiguousarray(embeddings, dtype="<f4").tobytes()
    output["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps(header).encode()
    return head + raw, {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(head))}


# --------------------------------------------------------------------------- the app


def create_app(threads: int | None = None, embedder: TorchEmbedder | None = None):
    """The FastAPI app; loads the model (``threads`` torch intra-op threads) before it returns."""
    embedder = embedder or TorchEmbedder(threads or cpu_threads())
    stats = Statistics()
    # One worker: requests run the model one after another (see the module docstring).
    worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
    app = FastAPI(title="naive all-MiniLM-L6-v2 (PyTorch, one request at a time)")
    app.state.embedder = embedder
    app.state.stats = stats

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    def check_model(name: str, version: str | None = None) -> JSONResponse | None:
        if name != MODEL or version not in (None, "", VERSION):
            return error(404, f"unknown model {name!r} version {version!r}; this server serves {MODEL!r} version {VERSION}")
        return None

    @app.get("/v2")
    def server_metadata():
        return {"name": "naive_pytorch", "version": "0", "extensions": ["binary_tensor_data", "statistics"]}

    @app.get("/v2/health/live")
    @app.get("/v2/health/ready")
    def health():
        return Response(status_code=200)

    # Before /v2/models/{name}: routes match in order, and "stats" is not a model.
    @app.get("/v2/models/stats")
    @app.get("/v2/models/{name}/stats")
    @app.get("/v2/models/{name}/versions/{version}/stats")
    def statistics(name: str | None = None, version: str | None = None):
        if name is not None and (missing := check_model(name, version)):
            return missing
        return stats.as_json()

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    def model_ready(name: str, version: str | None = None):
        return check_model(name, version) or Response(status_code=200)

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    def model_metadata(name: str, version: str | None = None):
        return check_model(name, version) or METADATA

    @app.get("/v2/models/{name}/config")
    @app.get("/v2/models/{name}/versions/{version}/config")
    def model_config(name: str, version: str | None = None):
        return check_model(name, version) or CONFIG

    def run_model(texts: list[str], arrived_ns: int) -> tuple[np.ndarray, tuple[int, int, int, int]]:
        started = time.monotonic_ns()
        ids, mask = embedder.tokenize(texts)
        tokenized = time.monotonic_ns()
        hidden = embedder.encode(ids, mask)
        encoded = time.monotonic_ns()
        embeddings = embedder.pool(hidden, mask)
        done = time.monotonic_ns()
        return embeddings, (started - arrived_ns, tokenized - started, encoded - tokenized, done - encoded)

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str | None = None):
        arrived = time.monotonic_ns()
        if missing := check_model(name, version):
            return missing
        try:
            parsed = parse_infer_request(await request.body(), request.headers.get(HEADER_LENGTH))
        except RequestError as exc:
            stats.record_failure(time.monotonic_ns() - arrived)
            return error(400, str(exc))
        try:
            loop = asyncio.get_running_loop()
            embeddings, (queue, tok, enc, pool) = await loop.run_in_executor(worker, run_model, parsed.texts, arrived)
        except Exception as exc:  # the model failed: the client gets the reason, the log the traceback
            log.exception("inference failed for request %s", parsed.request_id)
            stats.record_failure(time.monotonic_ns() - arrived)
            return error(500, f"inference failed: {exc}")
        body, headers = response_body(parsed, embeddings)
        stats.record_success(len(parsed.texts), time.monotonic_ns() - arrived, queue, tok, enc, pool)
        media_type = headers.pop("content-type")
        return Response(content=body, media_type=media_type, headers=headers)

    return app


class NaiveServer:
    """``python -m perf.baselines.naive_server`` as a child process (what perf.bench.compare and the tests start).

    ``start()``, ``wait_ready()``, ``stop()``; the output goes to ``log_path``.
    """

    def __init__(self, port: int, log_path: Path, threads: int | None = None, host: str = "127.0.0.1"):
        self.host, self.port, self.log_path = host, port, Path(log_path)
        self.threads = threads or cpu_threads()
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> NaiveServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log_file:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "perf.baselines.naive_server",
                    "--host",
                    self.host,
                    "--port",
                    str(self.port),
                    "--threads",
                    str(self.threads),
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                start_new_session=True,
            )
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Poll /v2/health/ready; raises RuntimeError (with the log's end) if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"naive server exited with code {code} before becoming ready\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"naive server not ready after {timeout:.0f} s\n{self.log_tail()}")

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

    def __enter__(self) -> NaiveServer:
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
        prog="python -m perf.baselines.naive_server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--threads",
        type=int,
        default=cpu_threads(),
        help="torch intra-op threads (default: this process's CPUs, what ONNX Runtime gets in Triton)",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn log level (info logs every request)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")

    import uvicorn

    app = create_app(threads=args.threads)
    log.info("naive server: PyTorch on %d threads, http://%s:%d/v2/models/%s", args.threads, args.host, args.port, MODEL)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.log_level == "info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
