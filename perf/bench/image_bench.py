"""`python -m perf.bench.image_bench` (`make image-bench`): the served image ensembles against ONNX Runtime in-process.

For each ensemble given with ``--ensembles`` (default: ``image_classification``, the default
model, and ``image_classification_resnet50``; one that the repository lacks is skipped with a
note), its steps are read from its config.pbtxt: the preprocessing step (the one fed IMAGE),
the classifier (the onnxruntime step) and the postprocessing step. ``--precision`` is resolved
as the server resolves it (export/variants.py): one ``--model-config-name`` for the server,
and per classifier the variant, hence the .onnx file, it serves.

Two systems run the same pipeline on the same photos, preprocessing and postprocessing
included in both (JPEG bytes in, top-5 out):

  served      one tritonserver (no front door, no response cache: nothing answers from memory)
              loading every ensemble; an asyncio HTTP client keeps ``--concurrency`` requests in
              flight, each carrying ``batch`` images ([batch, 1] BYTES), for ``--duration``
              seconds after ``--warmup``; every latency is kept (P50, P99, max). Triton's
              statistics around each window give the classifier's mean executed batch.
  in-process  the same .onnx file in an ONNX Runtime session (OpenVINO for the openvino variant) with the served config's intra-op
              threads, spinning off; python_backends.image's preprocessing configured from the
              served preprocessing config and its top-k from the postprocessing config; the
              same batches of the same photos, for ``--inprocess-seconds``. Two layouts: one
              thread doing decode -> model -> top-k in a loop, and the served layout (as many
              threads as the preprocessing step has instances, at most as many model runs at
              once as the classifier has instances); the faster one is the in-process figure.

Before measuring, each photo goes once through both and their top-5 classes must agree (the
same model, the same preprocessing), or the run stops. Windows are interleaved: per round, per
ensemble and batch size, the served window then the in-process one; figures are medians over
``--rounds`` (max: the largest). Ratios: served / in-process per ensemble and batch, and the
first ensemble over each other one (throughput) in-process and served.

The photos are the classifier's evaluation photos (export/image_data.EVALUATION_PHOTOS),
whole, JPEG-encoded once at quality 90. Writes image_bench.md (the tables), image_bench.csv
(every window) and tritonserver.log under perf/results/image-bench-<UTC time>/ (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import io
import json
import os
import platform
import shutil
import struct
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from perf.lib.harness import write_csv
from perf.lib.paths import REPOSITORY
from perf.lib.paths import RESULTS as DEFAULT_RESULTS
from perf.lib.stats import median, percentile

DEFAULT_ENSEMBLES = ("image_classification", "image_classification_resnet50")
JPEG_QUALITY = 90


# --------------------------------------------------------------------------- what is served


@dataclass(frozen=True)
class Pipeline:
    """One served image ensemble and what the in-process side needs to run the same thing."""

    ensemble: str
    preprocess: str
    classifier: str
    postprocess: str
    variant: str  # the classifier's precision variant (fp32, cpu_opt, int8, ...)
    model_path: Path  # the .onnx file that variant serves
    threads: int  # the classifier config's intra-op (openvino: inference) threads (0 = one per core, resolved)
    classifier_instances: int
    preprocess_instances: int
    max_batch_size: int
    weights: str  # the classifier export manifest's provenance, or ""


def parse_config(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def config_dict(text: str) -> dict:
    """A config.pbtxt text as the JSON Triton hands a Python model (contract.model_config.ModelConfig)."""
    from google.protobuf import json_format

    return json_format.MessageToDict(parse_config(text), preserving_proto_field_name=True)


def ensemble_steps(repo: Path, ensemble: str) -> tuple[str, str, str]:
    """(preprocessing, classifier, postprocessing) model names of an image ensemble's config.pbtxt:
    the step fed the ensemble's IMAGE, the step whose backend is onnxruntime, the step that
    produces LABEL. Raises ValueError when the ensemble does not have that shape."""
    config = parse_config((repo / ensemble / "config.pbtxt").read_text())
    if config.platform != "ensemble":
        raise ValueError(f"{ensemble} is not an ensemble (platform {config.platform!r})")
    steps = list(config.ensemble_scheduling.step)
    pre = [s.model_name for s in steps if "IMAGE" in s.input_map.values()]
    post = [s.model_name for s in steps if "LABEL" in s.output_map.values()]
    cnn = [
        s.model_name for s in steps if parse_config((repo / s.model_name / "config.pbtxt").read_text()).backend == "onnxruntime"
    ]
    if len(pre) != 1 or len(post) != 1 or len(cnn) != 1:
        raise ValueError(
            f"{ensemble}: expected one preprocessing step (fed IMAGE), one onnxruntime classifier and "
            f"one step producing LABEL; found {pre}, {cnn}, {post}"
        )
    return pre[0], cnn[0], post[0]


def resolve(repo: Path, ensembles: Sequence[str], precision: str) -> tuple[str | None, list[Pipeline]]:
    """Triton's --model-config-name for ``precision`` and each ensemble's Pipeline."""
    from export import bench
    from export.variants import VARIANTS, resolve_precision
    from perf.lib.served import config_parameter, instance_count, served_config_text

    steps = {e: ensemble_steps(repo, e) for e in ensembles}
    config_name, served = resolve_precision(repo, [cnn for _, cnn, _ in steps.values()], precision)
    out = []
    for ensemble, (pre, cnn, post) in steps.items():
        text = served_config_text(repo, cnn, config_name)
        # ONNX Runtime's intra-op threads, or the openvino backend's INFERENCE_NUM_THREADS
        threads_value = config_parameter(text, "intra_op_thread_count") or config_parameter(text, "INFERENCE_NUM_THREADS")
        threads = int(threads_value or 0) or bench.cpu_threads()
        manifest = repo / cnn / "1" / "model.export.json"
        weights = ""
        if manifest.is_file():
            try:
                weights = str(json.loads(manifest.read_text()).get("provenance", ""))
            except json.JSONDecodeError:
                pass
        out.append(
            Pipeline(
                ensemble,
                pre,
                cnn,
                post,
                served[cnn],
                repo / cnn / "1" / VARIANTS[served[cnn]].filename,
                threads,
                instance_count(text),
                instance_count(served_config_text(repo, pre, config_name)),
                parse_config(text).max_batch_size,
                weights,
            )
        )
    return config_name, out


# --------------------------------------------------------------------------- the photos


def photo_jpegs(names: Sequence[str] | None = None) -> list[tuple[str, bytes]]:
    """(name, JPEG bytes) of each bundled evaluation photo, whole, encoded once."""
    from export.image_data import EVALUATION_PHOTOS, load_photo

    out = []
    for name in names or EVALUATION_PHOTOS:
        buf = io.BytesIO()
        load_photo(name).save(buf, format="JPEG", quality=JPEG_QUALITY)
        out.append((name, buf.getvalue()))
    return out


def batch_of(blobs: Sequence[bytes], batch: int, k: int) -> list[bytes]:
    """The k-th batch of ``batch`` photos, cycling through them (both systems use this)."""
    return [blobs[(k * batch + j) % len(blobs)] for j in range(batch)]


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


# --------------------------------------------------------------------------- summary


@dataclass
class Point:
    """The median over rounds of one system x ensemble x batch (max: the largest)."""

    system: str
    ensemble: str
    batch: int
    layout: str
    images_per_s: float | None
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    classifier_batch: float | None = None
    client_cores: float | None = None
    machine_cores: float | None = None
    errors: int = 0
    rounds: int = 0
    requests: int = 0  # requests (served) or calls (in-process) measured, all rounds


def points(windows: Sequence[Window]) -> list[Point]:
    """Per system, ensemble and batch; in-process: the faster layout (by median images/s)."""
    groups: dict[tuple, list[Window]] = {}
    for w in windows:
        groups.setdefault((w.system, w.ensemble, w.batch, w.layout), []).append(w)
    candidates: dict[tuple, list[Point]] = {}
    for (system, ensemble, batch, layout), ws in groups.items():
        maxes = [w.max_ms for w in ws if w.max_ms is not None]
        candidates.setdefault((system, ensemble, batch), []).append(
            Point(
                system,
                ensemble,
                batch,
                layout,
                median([w.images_per_s for w in ws]),
                median([w.p50_ms for w in ws]),
                median([w.p99_ms for w in ws]),
                max(maxes) if maxes else None,
                median([w.classifier_batch for w in ws]),
                median([w.client_cores for w in ws]),
                median([w.machine_cores for w in ws]),
                sum(w.errors for w in ws),
                len(ws),
                sum(w.requests for w in ws),
            )
        )
    return [max(c, key=lambda p: p.images_per_s or 0.0) for c in candidates.values()]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(header: Sequence[str], pipes: Sequence[Pipeline], results: Sequence[Point]) -> str:
    by = {(p.system, p.ensemble, p.batch): p for p in results}
    batches = sorted({p.batch for p in results})
    lines = list(header) + [
        "",
        "## Served vs in-process (same .onnx file, same photos, preprocessing included in both)",
        "",
        "| ensemble | variant | batch | system | layout | n | images/s | P50 ms | P99 ms | max ms "
        "| classifier batch | cores: this process | machine | served / in-process |",
        "| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for pipe in pipes:
        for b in batches:
            served, mine = by.get(("served", pipe.ensemble, b)), by.get(("in-process", pipe.ensemble, b))
            for p in (served, mine, by.get(("model only", pipe.ensemble, b))):
                if p is None:
                    continue
                share = (
                    _f(ratio(served.images_per_s if served else None, mine.images_per_s if mine else None), 2)
                    if p is served
                    else ""
                )
                lines.append(
                    f"| {pipe.ensemble} | {pipe.variant} | {b} | {p.system} | {p.layout} | {p.requests} | "
                    f"{_f(p.images_per_s)} | {_f(p.p50_ms)} | {_f(p.p99_ms)} | {_f(p.max_ms)} | "
                    f"{_f(p.classifier_batch)} | {_f(p.client_cores, 2)} | {_f(p.machine_cores, 2)} | {share} |"
                )
    if len(pipes) > 1:
        first = pipes[0]
        lines += [
            "",
            f"## {first.ensemble} over each other ensemble (images/s ratio, same batch)",
            "",
            "| ensemble | batch | in-process | served |",
            "| --- | ---: | ---: | ---: |",
        ]
        for other in pipes[1:]:
            for b in batches:
                cells = [
                    _f(
                        ratio(
                            getattr(by.get((s, first.ensemble, b)), "images_per_s", None),
                            getattr(by.get((s, other.ensemble, b)), "images_per_s", None),
                        ),
                        2,
                    )
                    for s in ("in-process", "served")
                ]
                lines.append(f"| {first.ensemble} / {other.ensemble} | {b} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import onnxruntime

    from export import bench

    return (
        f"{model or platform.processor() or 'unknown CPU'}, {bench.cpu_threads()} cores usable, no GPU used "
        f"(CPUExecutionProvider), onnxruntime {onnxruntime.__version__}, Python {platform.python_version()}"
    )


# --------------------------------------------------------------------------- run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.image_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--ensembles",
        default=",".join(DEFAULT_ENSEMBLES),
        help="comma-separated image ensembles, the first compared with each other one "
        f"(default {','.join(DEFAULT_ENSEMBLES)}; missing ones are skipped)",
    )
    p.add_argument(
        "--precision",
        default="cpu",
        help="as PRECISION of `make serve`: cpu (the variant a CPU serves), fp32, cpu_opt, int8 (default cpu)",
    )
    p.add_argument("--batches", default="1,8", help="images per request / per in-process call (default 1,8)")
    p.add_argument("--concurrency", default="8,4", help="requests in flight, one per batch size or one for all (default 8,4)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per served window (default 5)")
    p.add_argument(
        "--min-requests",
        type=int,
        default=10,
        help="a served window lasts until this many requests completed in it, at most 6 x --duration (default 10)",
    )
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of load before each served window (default 1)")
    p.add_argument("--inprocess-seconds", type=float, default=3.0, help="seconds per in-process window and layout (default 3)")
    p.add_argument(
        "--no-model-only",
        dest="model_only",
        action="store_false",
        help="skip the in-process classifier-alone figure (pixels made beforehand)",
    )
    p.add_argument("--repository", type=Path, default=REPOSITORY, help="model repository (default model_repository)")
    p.add_argument("--out", type=Path, help="results folder (default perf/results/image-bench-<UTC time>)")
    p.add_argument("--no-export", action="store_true", help="never export, even when model files are missing")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.ensemble_list = [e.strip() for e in args.ensembles.split(",") if e.strip()]
    try:
        args.batch_list = [int(b) for b in args.batches.split(",")]
        conc = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error("--batches and --concurrency take comma-separated integers")
    if len(conc) == 1:
        conc *= len(args.batch_list)
    if len(conc) != len(args.batch_list):
        p.error("--concurrency needs one value, or one per batch size")
    args.concurrency_of = dict(zip(args.batch_list, conc))
    if not args.ensemble_list or min(args.batch_list + conc) < 1 or args.rounds < 1:
        p.error("ensembles, batch sizes, concurrency and rounds must be given and positive")
    if args.duration <= 0 or args.warmup < 0 or args.inprocess_seconds <= 0:
        p.error("--duration and --inprocess-seconds must be > 0, --warmup >= 0")
    return args


def ensure_exported(repo: Path, pipes: Sequence[Pipeline], no_export: bool, say: Callable[[str], None]) -> bool:
    """Export the classifiers whose served file is missing (`python -m export --model <classifier>
    --no-speed`). Returns whether anything was exported (the variants may then differ)."""
    missing = [
        p.classifier for p in pipes if not p.model_path.is_file() or not (repo / p.postprocess / "1" / "labels.txt").is_file()
    ]
    if not missing or no_export:
        return False
    from export import __main__ as export_main

    say(f"perf.bench.image_bench: exporting {', '.join(missing)} (model files missing)")
    args = ["--no-speed", "--repository", str(repo)]
    for name in dict.fromkeys(missing):
        args += ["--model", name]
    try:
        export_main.main(args)
    except SystemExit as exc:  # an exporter that does not know the model: said, and the run reports the file
        say(f"perf.bench.image_bench: export {' '.join(args)} exited with {exc.code}")
    return True


def run(args: argparse.Namespace) -> int:
    from server.process import ServerError, ServerOptions, TritonServer

    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:5.0f} s] {message}", flush=True)

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or DEFAULT_RESULTS / f"image-bench-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    repo = args.repository.resolve()
    load_avg = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    present = [e for e in args.ensemble_list if (repo / e / "config.pbtxt").is_file()]
    notes = [f"{e} is not in the repository: skipped" for e in args.ensemble_list if e not in present]
    for note in notes:
        say(f"perf.bench.image_bench: {note}")
    if not present:
        say("perf.bench.image_bench: no ensemble to measure")
        return 1
    config_name, pipes = resolve(repo, present, args.precision)
    if ensure_exported(repo, pipes, args.no_export, say):
        config_name, pipes = resolve(repo, present, args.precision)
    photos = photo_jpegs()
    blobs = [b for _, b in photos]
    described = ", ".join(f"{p.ensemble} ({p.classifier}: {p.variant}, {p.model_path.name})" for p in pipes)
    say(
        f"perf.bench.image_bench: {described}"
        f"; --model-config-name={config_name or '(none)'}; {len(photos)} photos, {sum(map(len, blobs)) // 1024} KiB"
    )
    models = [p.ensemble for p in pipes]
    workdir = Path(tempfile.mkdtemp(prefix="perf-image-bench-"))
    server = TritonServer(
        ServerOptions.with_free_ports(
            workdir=workdir, model_repository=repo, models=models, model_config_name=config_name, front_door=False
        )
    )
    windows: list[Window] = []
    failure = ""
    agreement: dict[str, float] = {}
    try:
        runners = {p.ensemble: InProcess(p, repo, config_name) for p in pipes}
        model_only = {e: r.model_only(blobs) for e, r in runners.items()} if args.model_only else {}
        server.start()
        try:
            server.wait_ready(timeout=300)
        except ServerError as exc:
            raise RuntimeError(f"{exc}\n{exc.log_tail}") from None
        say(f"tritonserver ready on {server.http_url} ({', '.join(models)})")
        for pipe in pipes:
            agreement[pipe.ensemble] = check_same(server.http_url, runners[pipe.ensemble], photos)
            say(
                f"{pipe.ensemble}: served and in-process top-5 agree on every photo "
                f"(largest score difference {agreement[pipe.ensemble]:.1e})"
            )
        for rnd in range(1, args.rounds + 1):
            for pipe in pipes:
                for b in args.batch_list:
                    if b > pipe.max_batch_size:
                        continue
                    conc = args.concurrency_of[b]
                    w = Window("served", pipe.ensemble, b, rnd, f"c{conc}")
                    meter = MachineMeter()
                    measure_served(server.http_url, pipe, blobs, b, conc, args.warmup, args.duration, w, args.min_requests)
                    meter.stop(w)
                    windows.append(w)
                    say(
                        f"r{rnd} {pipe.ensemble:32} b{b:<3} served     {w.layout:4} {_f(w.images_per_s):>7} images/s  "
                        f"P50 {_f(w.p50_ms):>7}  P99 {_f(w.p99_ms):>7}  max {_f(w.max_ms):>7} ms  classifier batch "
                        f"{_f(w.classifier_batch)}  client {_f(w.client_cores, 2)} machine {_f(w.machine_cores, 2)} cores  "
                        f"errors {w.errors}" + (f" ({w.first_error})" if w.first_error else "")
                    )
                    layouts: list[tuple[str, int, Callable[[Sequence[bytes]], object]]] = [
                        ("in-process", t, runners[pipe.ensemble]) for t in sorted({1, pipe.preprocess_instances})
                    ]
                    if args.model_only:
                        layouts.append(("model only", 1, model_only[pipe.ensemble]))
                    for system, threads, runner in layouts:
                        w = Window(system, pipe.ensemble, b, rnd, f"{threads}t")
                        meter = MachineMeter()
                        measure_inprocess(runner, blobs, b, threads, args.inprocess_seconds, w)
                        meter.stop(w)
                        windows.append(w)
                        say(
                            f"r{rnd} {pipe.ensemble:32} b{b:<3} {system:10} {w.layout:4} {_f(w.images_per_s):>7} "
                            f"images/s  P50 {_f(w.p50_ms):>7}  P99 {_f(w.p99_ms):>7}  max {_f(w.max_ms):>7} ms  "
                            f"this process {_f(w.client_cores, 2)} machine {_f(w.machine_cores, 2)} cores  "
                            f"errors {w.errors}" + (f" ({w.first_error})" if w.first_error else "")
                        )
    except Exception as exc:  # noqa: BLE001 - reported with what was measured
        failure = f"{type(exc).__name__}: {exc}"
        say(f"perf.bench.image_bench stopped: {failure}")
    finally:
        server.stop()
        if server.log_path.is_file():
            shutil.copyfile(server.log_path, out / "tritonserver.log")
        shutil.rmtree(workdir, ignore_errors=True)

    results = points(windows)
    header = [
        "# Image classification: served ensembles against ONNX Runtime in-process",
        "",
        f"- {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}; load average before {load_avg}, "
        f"after {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- command: `{' '.join(['python -m perf.bench.image_bench', *args.argv])}`",
        f"- precision {args.precision}: --model-config-name={config_name or '(none)'}; "
        + "; ".join(
            f"{p.classifier} serves {p.variant} ({p.model_path.name}, {p.threads} intra-op threads x "
            f"{p.classifier_instances} instance(s); weights {p.weights or 'unknown'}), {p.preprocess} "
            f"{p.preprocess_instances} instance(s)"
            for p in pipes
        ),
        (
            f"- {len(photos)} photos (the evaluation photos, whole, JPEG quality {JPEG_QUALITY}), batches "
            f"cycling through them; served: tritonserver without front door or response cache, HTTP (binary tensors), "
            f"{', '.join(f'batch {b} at concurrency {c}' for b, c in args.concurrency_of.items())}, {args.warmup:g} s "
            f"warm-up (and until as many requests as in flight completed) + {args.duration:g} s per window (longer "
            f"until {args.min_requests} requests completed in it, at most {6 * args.duration:g} s); in-process: "
            f"{args.inprocess_seconds:g} s (at least 3 calls) per layout "
            f"(`1t`: one thread; `2t`: the served layout, threads = preprocessing instances, model runs at once <= "
            f"classifier instances), the faster shown; {args.rounds} interleaved round(s), medians (max: the largest)"
        ),
        "- both systems: JPEG bytes in, top-5 out (decode, resize, crop, normalise, the classifier, softmax and top-k); "
        "latency is per request (served) or per call (in-process) of `batch` images; classifier batch: the served "
        "classifier's mean executed batch (Triton's statistics); cores, this process: the load generator's CPU "
        "(served) or the pipeline's own (in-process); machine: busy cores of the whole machine, neighbours included; "
        "model only: the classifier's session alone on pixels made beforehand (what decoding and top-k leave); n: "
        "requests (served) or calls (in-process) measured over all rounds; with few, P99 is the max",
    ]
    if agreement:
        header.append(
            "- served and in-process top-5 classes agree on every photo; largest score difference "
            + ", ".join(f"{e} {d:.1e}" for e, d in agreement.items())
        )
    header += [f"- {n}" for n in notes]
    if failure:
        header.append(f"- stopped early: {failure.splitlines()[0]}")
    errors = sum(w.errors for w in windows)
    if errors:
        header.append(f"- {errors} failed requests; first: {next(w.first_error for w in windows if w.errors)}")
    table = markdown(header, pipes, results)
    (out / "image_bench.md").write_text(table)
    write_csv(out / "image_bench.csv", [w.record() for w in windows])
    print("\n" + table, flush=True)
    say(f"perf.bench.image_bench: results in {out}")
    expected = sum(len([b for b in args.batch_list if b <= p.max_batch_size]) for p in pipes) * (3 if args.model_only else 2)
    complete = len(results) == expected and all(p.images_per_s for p in results)
    return 0 if not failure and not errors and complete else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
