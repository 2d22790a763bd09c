"""`python -m perf.baselines.naive_server --port N`: the naive per-request baseline of perf.bench.compare.

The seed articles' "original implementation": FastAPI under uvicorn running PyTorch all-MiniLM-L6-v2
(export/reference.py) once per request, FP32, no batching. It speaks enough KServe v2 HTTP (health,
metadata, config, JSON and binary-tensor infer, statistics with the queue / tokenize / model / pool
split) that perf_analyzer drives it exactly like Triton's ``text_embedding``. ONE worker thread runs
the model, one request after another (the wait for it is the queue time): with torch on the intra-op
threads ONNX Runtime gets in Triton, running several at once would only oversubscribe the cores, so
the served/naive ratio is no strawman's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from contract.errors import InputError
from export.bench import cpu_threads
from perf.lib import options
from perf.lib.paths import ROOT
from python_backends.text.tokenization import decode_texts
from server.supervisor import ChildProcess, NotReady, Service, http_status

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
        {"name": INPUT, "data_type": "TYPE_STRING", "format": "FORMAT_NONE", "dims": [1]}
        | {"is_shape_tensor": False, "allow_ragged_batch": False, "optional": False}
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
PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


class RequestError(ValueError):
    """A malformed inference request: answered with HTTP 400 and this message."""


class Statistics:
    """Cumulative figures in the KServe/Triton statistics extension's JSON shape."""

    def __init__(self) -> None:
        self.inferences = self.executions = self.last_ms = 0
        self.phases = {k: [0, 0] for k in PHASES}  # phase -> [count, ns]
        self.lock = threading.Lock()

    def record(self, n: int, **ns: int) -> None:
        """One execution of ``n`` texts (0: a failed request) and each phase's nanoseconds."""
        with self.lock:
            self.inferences, self.executions = self.inferences + n, self.executions + (n > 0)
            self.last_ms = int(time.time() * 1000) if n else self.last_ms
            for phase, value in ns.items():
                self.phases[phase][0] += 1
                self.phases[phase][1] += value

    def as_json(self) -> dict[str, Any]:
        with self.lock:
            stats = {k: {"count": c, "ns": ns} for k, (c, ns) in self.phases.items()}
            entry = {"name": MODEL, "version": VERSION, "last_inference": self.last_ms, "inference_count": self.inferences}
            entry |= {"execution_count": self.executions, "inference_stats": stats}
            entry |= {"response_stats": {}, "batch_stats": [], "memory_usage": []}
            return {"model_stats": [entry]}


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
    header_bytes, binary = body, b""
    if header_length is not None:
        try:
            json_length = int(header_length)
        except ValueError:
            raise RequestError(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 < json_length <= len(body):
            raise RequestError(f"{HEADER_LENGTH}={json_length} does not fit a body of {len(body)} bytes")
        header_bytes, binary = body[:json_length], body[json_length:]
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise RequestError("request body must be a JSON object")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError("request needs a non-empty 'inputs' list")
    found, offset = None, 0
    for tensor in inputs:
        if not isinstance(tensor, dict):
            raise RequestError("each entry of 'inputs' must be an object")
        if tensor.get("name") != INPUT:
            raise RequestError(f"unexpected input {tensor.get('name')!r}; model {MODEL} has one input, {INPUT!r}")
        params = tensor.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        chunk = None
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise RequestError(f"input {INPUT!r}: binary_data_size {size!r} does not fit the binary data")
            chunk, offset = binary[offset : offset + size], offset + size
        found = (tensor, chunk)
    assert found is not None  # inputs is a non-empty list of INPUT tensors
    tensor, chunk = found
    if tensor.get("datatype") != "BYTES":
        raise RequestError(f"input {INPUT!r} must have datatype BYTES, got {tensor.get('datatype')!r}")
    shape = tensor.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) for d in shape) and shape[1] == 1):
        raise RequestError(f"input {INPUT!r} must have shape [n, 1], got {shape!r}")
    if not 1 <= shape[0] <= MAX_BATCH:
        raise RequestError(f"input {INPUT!r}: batch of {shape[0]} texts; between 1 and {MAX_BATCH} allowed")
    if chunk is not None:
        values: list[Any] = _split_bytes(chunk, INPUT)
    elif "data" in tensor:
        values = list(np.array(tensor["data"], dtype=object).reshape(-1))
    else:
        raise RequestError(f"input {INPUT!r} has neither 'data' nor binary_data_size")
    if len(values) != shape[0]:
        raise RequestError(f"input {INPUT!r}: shape {shape} needs {shape[0]} elements, got {len(values)}")
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


def create_app(threads: int | None = None):
    """The FastAPI app; loads PyTorch all-MiniLM-L6-v2 (``threads`` intra-op threads) before it returns."""
    import torch

    from export import reference

    torch.set_num_threads(threads or cpu_threads())
    reference.load_torch_model()
    reference.load_hf_tokenizer()
    reference.embed(["warm-up"])  # the first call allocates; keep it out of the measurements
    stats = Statistics()
    # One worker: requests run the model one after another (see the module docstring).
    worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
    app = FastAPI(title="naive all-MiniLM-L6-v2 (PyTorch, one request at a time)")

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
        return (name is not None and check_model(name, version)) or stats.as_json()

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

    def run_model(texts: list[str], arrived: int) -> tuple[np.ndarray, list[int]]:
        marks = [arrived, time.monotonic_ns()]
        ids, mask = reference.tokenize(texts)
        marks.append(time.monotonic_ns())
        hidden = reference.token_embeddings(ids, mask)
        marks.append(time.monotonic_ns())
        embeddings = reference.pool(hidden, mask)
        marks.append(time.monotonic_ns())
        return embeddings, [b - a for a, b in zip(marks, marks[1:])]  # queue, tokenize, encode, pool

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str | None = None):
        arrived = time.monotonic_ns()
        if missing := check_model(name, version):
            return missing
        try:
            parsed = parse_infer_request(await request.body(), request.headers.get(HEADER_LENGTH))
        except RequestError as exc:
            stats.record(0, fail=time.monotonic_ns() - arrived)
            return error(400, str(exc))
        try:
            loop = asyncio.get_running_loop()
            embeddings, (queue, tok, enc, pool) = await loop.run_in_executor(worker, run_model, parsed.texts, arrived)
        except Exception as exc:  # the model failed: the client gets the reason, the log the traceback
            log.exception("inference failed for request %s", parsed.request_id)
            stats.record(0, fail=time.monotonic_ns() - arrived)
            return error(500, f"inference failed: {exc}")
        body, headers = response_body(parsed, embeddings)
        total = time.monotonic_ns() - arrived
        stats.record(len(parsed.texts), success=total, queue=queue, compute_input=tok, compute_infer=enc, compute_output=pool)
        return Response(content=body, media_type=headers.pop("content-type"), headers=headers)

    return app


class NaiveServer(Service):
    """``python -m perf.baselines.naive_server`` as a child process (what perf.bench.compare starts):
    ``start()``, ``wait_ready()`` (RuntimeError with the log's end when it exits or times out), ``stop()``,
    or a context manager; the output goes to ``log_path``."""

    def __init__(self, port: int, log_path: Path, threads: int | None = None, host: str = "127.0.0.1"):
        self.host, self.port, self.threads = host, port, threads or cpu_threads()
        self.child = ChildProcess("naive server", log_path, log_mode="w", grace=15.0)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> NaiveServer:
        command = [sys.executable, "-m", "perf.baselines.naive_server", "--host", self.host, "--port", str(self.port)]
        self.child.start([*command, "--threads", str(self.threads)], cwd=ROOT)
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        try:
            self.child.wait_ready(lambda: http_status(f"http://{self.http_url}/v2/health/ready") == 200, timeout, interval=0.25)
        except NotReady as exc:
            raise RuntimeError(f"naive server {exc} before becoming ready ({timeout:.0f} s)\n{self.child.log_tail(40)}") from None

    def stop(self) -> int | None:
        return self.child.stop(kill_group=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = options.parser("perf.baselines.naive_server", __doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--threads", type=int, default=cpu_threads(), help="torch intra-op threads (default: this process's CPUs)")
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
