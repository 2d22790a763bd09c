"""perf.bench.image_bench's measurements: the pipeline in this process (ONNX Runtime) and the served
ensemble over HTTP, each window with its latencies and CPU use."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from perf.bench.image_pipelines import Pipeline, batch_of, config_dict
from perf.lib.stats import percentile

# --------------------------------------------------------------------------- in-process


class InProcess:
    """The served pipeline in this process: decode and preprocess, the classifier's ONNX file, top-k."""

    def __init__(self, pipe: Pipeline, repo: Path, config_name: str | None):
        from contract.model_config import ModelConfig
        from export import bench
        from perf.lib.served import served_config_text
        from python_backends.image.postprocess import TopKClassifier, load_labels
        from python_backends.image.preprocess import PreprocessOptions

        if not pipe.model_path.is_file():
            raise FileNotFoundError(f"{pipe.model_path} not found (run `make export`)")
        self.pipe = pipe
        self.options = PreprocessOptions.from_config(
            ModelConfig(config_dict(served_config_text(repo, pipe.preprocess, config_name)))
        )
        post = ModelConfig(config_dict(served_config_text(repo, pipe.postprocess, config_name)))
        (classes,) = post.require("input", "logits", "TYPE_FP32").dims
        labels = load_labels(repo / pipe.postprocess / "1" / (post.param("labels_file") or "labels.txt"), classes)
        self.classify = TopKClassifier(labels, post.param_int("top_k", 5, minimum=1))
        # what serves the variant: OpenVINO for openvino, else ONNX Runtime
        self.sessions = [
            bench.open_session(pipe.variant, pipe.model_path, pipe.threads) for _ in range(pipe.classifier_instances)
        ]
        first = self.sessions[0]
        self.input_name = next(iter(first.inputs)) if pipe.variant == "openvino" else first.get_inputs()[0].name
        self._free = list(range(len(self.sessions)))
        self._lock = threading.Condition()

    def __call__(self, blobs: Sequence[bytes]):
        """JPEG bytes -> TopK, one model run for the whole batch (a free session, as Triton
        hands an execution to a free instance)."""
        from python_backends.image.preprocess import preprocess

        pixels = preprocess(np.array(list(blobs), dtype=object), "IMAGE", self.options)
        with self._lock:
            self._lock.wait_for(lambda: self._free)
            slot = self._free.pop()
        try:
            (logits,) = self.sessions[slot].run(None, {self.input_name: pixels})
        finally:
            with self._lock:
                self._free.append(slot)
                self._lock.notify()
        return self.classify(logits)

    def model_only(self, blobs: Sequence[bytes]) -> Callable[[Sequence[bytes]], object]:
        """A runner of the classifier alone on the photos' pixels, made here once: what
        decoding and top-k leave of the pipeline's time."""
        from python_backends.image.preprocess import preprocess

        pixels = {b: preprocess(np.array([b], dtype=object), "IMAGE", self.options)[0] for b in blobs}
        session = self.sessions[0]
        return lambda chunk: session.run(None, {self.input_name: np.stack([pixels[b] for b in chunk])})


@dataclass
class Window:
    """One measurement: a system, an ensemble, a batch size, a round."""

    system: str  # served, in-process
    ensemble: str
    batch: int
    round: int
    layout: str = ""  # served: "c<concurrency>"; in-process: "<threads>t" (threads x the pipeline)
    requests: int = 0
    images: int = 0
    seconds: float = 0.0
    errors: int = 0
    first_error: str = ""
    images_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    client_cores: float | None = None
    classifier_batch: float | None = None  # served: the classifier's mean executed batch
    classifier_compute_ms: float | None = None  # per request, from Triton's statistics
    classifier_queue_ms: float | None = None
    machine_cores: float | None = None  # busy cores of the whole machine over the window (/proc/stat)

    def set_latencies(self, latencies_s: Sequence[float]) -> None:
        if not latencies_s:
            return
        ms = sorted(x * 1000.0 for x in latencies_s)
        self.p50_ms, self.p99_ms, self.max_ms = percentile(ms, 50), percentile(ms, 99), ms[-1]
        self.images_per_s = self.images / self.seconds if self.seconds > 0 else None

    def record(self) -> dict:
        out = {k: v for k, v in self.__dict__.items()}
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def busy_jiffies() -> tuple[float, float] | None:
    """(busy, total) CPU time of the whole machine in seconds (/proc/stat), or None."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return (sum(fields) - idle) / tick, sum(fields) / tick


class MachineMeter:
    """Busy cores of the whole machine between start() and stop(): what the neighbours took too."""

    def __init__(self) -> None:
        self.t0, self.busy0 = time.monotonic(), busy_jiffies()

    def stop(self, window: Window) -> None:
        busy1 = busy_jiffies()
        if self.busy0 is not None and busy1 is not None:
            window.machine_cores = (busy1[0] - self.busy0[0]) / max(time.monotonic() - self.t0, 1e-9)


def measure_inprocess(
    runner: Callable[[Sequence[bytes]], object],
    blobs: Sequence[bytes],
    batch: int,
    threads: int,
    seconds: float,
    window: Window,
    min_calls: int = 3,
) -> None:
    """``threads`` threads each running the pipeline on successive batches for ``seconds``."""
    latencies: list[list[float]] = [[] for _ in range(threads)]
    counter = iter(range(10**12))
    lock = threading.Lock()
    start_line = threading.Barrier(threads)
    failures: list[str] = []

    def loop(i: int) -> None:
        start_line.wait()
        deadline = time.perf_counter() + seconds
        while len(latencies[i]) < min_calls or time.perf_counter() < deadline:
            with lock:
                k = next(counter)
            chunk = batch_of(blobs, batch, k)
            t0 = time.perf_counter()
            try:
                runner(chunk)
            except Exception as exc:  # noqa: BLE001 - counted, the window stops
                failures.append(f"{type(exc).__name__}: {exc}"[:300])
                return
            latencies[i].append(time.perf_counter() - t0)

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    cpu0, t0 = time.process_time(), time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    window.seconds = time.perf_counter() - t0
    window.client_cores = (time.process_time() - cpu0) / max(window.seconds, 1e-9)
    flat = [x for per in latencies for x in per]
    window.requests, window.images = len(flat), len(flat) * batch
    window.errors, window.first_error = len(failures), failures[0] if failures else ""
    window.set_latencies(flat)


# --------------------------------------------------------------------------- served


def image_body(blobs: Sequence[bytes]) -> tuple[bytes, dict[str, str]]:
    """A KServe v2 HTTP request of ``len(blobs)`` images ([n, 1] BYTES) in Triton's binary
    extension; the outputs come back binary too (cheap for the client to skip)."""
    raw = b"".join(struct.pack("<I", len(b)) + b for b in blobs)
    header = json.dumps(
        {
            "inputs": [
                {"name": "IMAGE", "shape": [len(blobs), 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}}
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    return header + raw, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}


async def _closed_loop(
    url: str,
    bodies: Sequence[tuple[bytes, dict[str, str]]],
    concurrency: int,
    warmup: float,
    duration: float,
    min_requests: int = 10,
) -> tuple[list[float], int, str, float]:
    """Closed loop at ``concurrency``; the window counts the requests that complete in it.

    The window opens after ``warmup`` seconds once ``concurrency`` requests have completed (the
    pipeline is full: a slow model's first answers come after its warm-up), and closes at the
    first completion after ``duration`` seconds once ``min_requests`` completed in it, at the
    latest after 6 x ``duration``. Requests still in flight then are waited for, not counted.
    Returns (latencies in s, errors, first error, window seconds).
    """
    import aiohttp

    latencies: list[float] = []
    errors, first_error = 0, ""
    done = 0
    window: dict[str, float | None] = {"open": None, "close": None}
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=300), connector=aiohttp.TCPConnector(limit=concurrency)
    ) as session:
        started = time.monotonic()
        counter = iter(range(10**12))

        def completed(t: float, elapsed: float, ok: bool, payload: bytes) -> None:
            nonlocal done, errors, first_error
            done += 1
            opened = window["open"]
            if opened is None:
                if t >= started + warmup and done >= concurrency:
                    window["open"] = t
                return
            if window["close"] is not None:
                return
            if t >= opened + 6 * duration:
                window["close"] = opened + 6 * duration
                return
            if ok:
                latencies.append(elapsed)
            else:
                errors += 1
                first_error = first_error or payload[:200].decode(errors="replace")
            if t >= opened + duration and len(latencies) + errors >= min_requests:
                window["close"] = t

        async def client() -> None:
            while window["close"] is None:
                opened = window["open"]
                if opened is not None and time.monotonic() >= opened + 6 * duration:
                    window["close"] = opened + 6 * duration
                    return
                body, headers = bodies[next(counter) % len(bodies)]
                t0 = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=headers) as r:
                        payload = await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    ok, payload = False, repr(exc).encode()
                completed(time.monotonic(), time.perf_counter() - t0, ok, payload)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    opened, closed = window["open"], window["close"]
    measured = closed - opened if opened is not None and closed is not None else 0.0
    return latencies, errors, first_error, measured


def measure_served(
    http_url: str,
    pipe: Pipeline,
    blobs: Sequence[bytes],
    batch: int,
    concurrency: int,
    warmup: float,
    duration: float,
    window: Window,
    min_requests: int = 10,
) -> None:
    from perf.lib import triton_stats

    bodies = [image_body(batch_of(blobs, batch, k)) for k in range(len(blobs))]
    before = triton_stats.snapshot(http_url)
    cpu0, wall0 = time.process_time(), time.monotonic()
    latencies, errors, first_error, seconds = asyncio.run(
        _closed_loop(f"http://{http_url}/v2/models/{pipe.ensemble}/infer", bodies, concurrency, warmup, duration, min_requests)
    )
    window.client_cores = (time.process_time() - cpu0) / max(time.monotonic() - wall0, 1e-9)
    stats = triton_stats.fetch_delta(http_url, before).get(pipe.classifier)
    window.requests, window.images, window.seconds = len(latencies), len(latencies) * batch, seconds
    window.errors, window.first_error = errors, first_error
    window.set_latencies(latencies)
    if stats is not None:
        window.classifier_batch = stats.avg_batch
        window.classifier_compute_ms = stats.breakdown_ms.get("compute infer")
        window.classifier_queue_ms = stats.breakdown_ms.get("queue")


def served_top5(http_url: str, ensemble: str, blob: bytes) -> tuple[list[int], list[float]]:
    body, headers = image_body([blob])
    # JSON outputs for this one check: the binary parser is not worth it here.
    doc = json.loads(body[: int(headers["Inference-Header-Content-Length"])])
    doc["parameters"] = {"binary_data_output": False}
    header = json.dumps(doc).encode()
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/{ensemble}/infer",
        data=header + body[int(headers["Inference-Header-Content-Length"]) :],
        headers={"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        outputs = {o["name"]: o["data"] for o in json.loads(r.read())["outputs"]}
    return [int(x) for x in outputs["CLASS_INDEX"]], [float(x) for x in outputs["SCORE"]]


def check_same(http_url: str, runner: InProcess, photos: Sequence[tuple[str, bytes]]) -> float:
    """Each photo's top-5 classes served and in-process must be equal; returns the largest score
    difference. Raises RuntimeError naming the first photo where they differ."""
    worst = 0.0
    for name, blob in photos:
        indices, scores = served_top5(http_url, runner.pipe.ensemble, blob)
        mine = runner([blob])
        if list(mine.indices[0]) != indices:
            raise RuntimeError(
                f"{runner.pipe.ensemble}: {name}: served top-5 {indices} != in-process "
                f"{list(mine.indices[0])}: not the same model or preprocessing"
            )
        worst = max(worst, float(np.max(np.abs(np.asarray(scores) - mine.scores[0]))))
    return worst
