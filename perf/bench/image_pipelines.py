"""perf.bench.image_bench's two sides of one pipeline: what each ensemble serves (its steps, the
classifier file of the resolved precision), the same pipeline in this process, and the photos."""

from __future__ import annotations

import io
import json
import queue
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from perf.lib.served import served_config
from perf.lib.workload import image_request

DEFAULT_ENSEMBLES = ("image_classification", "image_classification_resnet50")
JPEG_QUALITY = 90


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


def ensemble_steps(repo: Path, ensemble: str) -> tuple[str, str, str]:
    """(preprocessing, classifier, postprocessing) of an image ensemble: the step fed IMAGE, the
    onnxruntime step, the step producing LABEL. ValueError when the ensemble has another shape."""
    config = served_config(repo, ensemble).raw
    if config.get("platform") != "ensemble":
        raise ValueError(f"{ensemble} is not an ensemble (platform {config.get('platform')!r})")
    steps = config["ensemble_scheduling"]["step"]
    pre = [s["model_name"] for s in steps if "IMAGE" in s.get("input_map", {}).values()]
    post = [s["model_name"] for s in steps if "LABEL" in s.get("output_map", {}).values()]
    cnn = [s["model_name"] for s in steps if served_config(repo, s["model_name"]).raw.get("backend") == "onnxruntime"]
    if len(pre) != 1 or len(post) != 1 or len(cnn) != 1:
        found = f"found {pre}, {cnn}, {post}"
        raise ValueError(f"{ensemble}: expected one step fed IMAGE, one onnxruntime classifier, one producing LABEL; {found}")
    return pre[0], cnn[0], post[0]


def resolve(repo: Path, ensembles: Sequence[str], precision: str) -> tuple[str | None, list[Pipeline]]:
    """Triton's --model-config-name for ``precision`` and each ensemble's Pipeline."""
    from export import bench
    from export.variants import VARIANTS, resolve_precision

    steps = {e: ensemble_steps(repo, e) for e in ensembles}
    config_name, served = resolve_precision(repo, [cnn for _, cnn, _ in steps.values()], precision)
    out = []
    for ensemble, (pre, cnn, post) in steps.items():
        config = served_config(repo, cnn, config_name)
        # ONNX Runtime's intra-op threads, or the openvino backend's INFERENCE_NUM_THREADS; 0: one per core
        threads = int(config.param("intra_op_thread_count") or config.param("INFERENCE_NUM_THREADS") or 0)
        manifest = repo / cnn / "1" / "model.export.json"  # written by the export, beside the file
        weights = str(json.loads(manifest.read_text()).get("provenance", "")) if manifest.is_file() else ""
        variant = served[cnn]
        path = repo / cnn / "1" / VARIANTS[variant].filename
        instances = (config.instance_count(), served_config(repo, pre, config_name).instance_count())
        pipe = Pipeline(
            ensemble, pre, cnn, post, variant, path, threads or bench.cpu_threads(), *instances, config.max_batch_size, weights
        )
        out.append(pipe)
    return config_name, out


class InProcess:
    """The served pipeline in this process: decode and preprocess, the classifier's file, top-k."""

    def __init__(self, pipe: Pipeline, repo: Path, config_name: str | None):
        from export import bench
        from python_backends.image.postprocess import TopKClassifier, load_labels
        from python_backends.image.preprocess import PreprocessOptions

        if not pipe.model_path.is_file():
            raise FileNotFoundError(f"{pipe.model_path} not found (run `make export`)")
        self.pipe = pipe
        self.options = PreprocessOptions.from_config(served_config(repo, pipe.preprocess, config_name))
        post = served_config(repo, pipe.postprocess, config_name)
        (classes,) = post.require("input", "logits", "TYPE_FP32").dims
        labels = load_labels(repo / pipe.postprocess / "1" / (post.param("labels_file") or "labels.txt"), classes)
        self.classify = TopKClassifier(labels, post.param_int("top_k", 5, minimum=1))
        # one session per served instance: OpenVINO for the openvino variant, else ONNX Runtime
        self.sessions: queue.Queue = queue.Queue()
        for _ in range(pipe.classifier_instances):
            self.sessions.put(bench.open_session(pipe.variant, pipe.model_path, pipe.threads))
        first = self.sessions.queue[0]
        self.input_name = next(iter(first.inputs)) if pipe.variant == "openvino" else first.get_inputs()[0].name

    def __call__(self, blobs: Sequence[bytes]):
        """JPEG bytes -> TopK, one model run for the batch on a free session (as Triton hands an
        execution to a free instance)."""
        from python_backends.image.preprocess import preprocess

        pixels = preprocess(np.array(list(blobs), dtype=object), "IMAGE", self.options)
        session = self.sessions.get()
        try:
            (logits,) = session.run(None, {self.input_name: pixels})
        finally:
            self.sessions.put(session)
        return self.classify(logits)

    def model_only(self, blobs: Sequence[bytes]) -> Callable[[Sequence[bytes]], object]:
        """The classifier alone on the photos' pixels, made here once: what decoding and top-k leave."""
        from python_backends.image.preprocess import preprocess

        pixels = {b: preprocess(np.array([b], dtype=object), "IMAGE", self.options)[0] for b in blobs}
        session = self.sessions.queue[0]
        return lambda chunk: session.run(None, {self.input_name: np.stack([pixels[b] for b in chunk])})


def check_same(http_url: str, runner: InProcess, photos: Sequence[tuple[str, bytes]]) -> float:
    """Each photo's top-5 classes, served and in-process, must be equal (RuntimeError naming the
    first photo where they differ); returns the largest score difference."""
    worst = 0.0
    for name, blob in photos:
        body, headers = image_request(blob, binary_output=False)
        request = urllib.request.Request(f"http://{http_url}/v2/models/{runner.pipe.ensemble}/infer", body, headers)
        with urllib.request.urlopen(request, timeout=60) as r:
            outputs = {o["name"]: o["data"] for o in json.loads(r.read())["outputs"]}
        indices, mine = [int(x) for x in outputs["CLASS_INDEX"]], runner([blob])
        if list(mine.indices[0]) != indices:
            differ = f"served top-5 {indices} != in-process {list(mine.indices[0])}"
            raise RuntimeError(f"{runner.pipe.ensemble}: {name}: {differ}: not the same model or preprocessing")
        worst = max(worst, float(np.max(np.abs(np.asarray(outputs["SCORE"], dtype=float) - mine.scores[0]))))
    return worst


def photo_jpegs() -> list[tuple[str, bytes]]:
    """(name, JPEG bytes) of each bundled evaluation photo, whole, encoded once."""
    from export.image_data import EVALUATION_PHOTOS, load_photo

    out = []
    for name in EVALUATION_PHOTOS:
        buf = io.BytesIO()
        load_photo(name).save(buf, format="JPEG", quality=JPEG_QUALITY)
        out.append((name, buf.getvalue()))
    return out


def batch_of(blobs: Sequence[bytes], batch: int, k: int) -> list[bytes]:
    """The k-th batch of ``batch`` photos, cycling through them (both systems use this)."""
    return [blobs[(k * batch + j) % len(blobs)] for j in range(batch)]
