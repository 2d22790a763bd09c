"""perf.bench.image_bench's pipelines: what each ensemble serves (its steps, the classifier file of
the resolved precision) and the photos both systems classify."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
