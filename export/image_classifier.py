"""Export ResNet-50 to ONNX for ``image_classifier`` and its labels for ``image_postprocess``.

Named tensors (pixel_values [batch, 3, 224, 224] -> logits [batch, 1000]), a dynamic batch
axis, opset 17, FP32. Weights: a torchvision-style state_dict given with ``--weights``, or
else a fixed-seed random initialisation with BatchNorm statistics re-estimated on the
calibration photos (see export/resnet.py); the manifest, the log and the README say which.

The exported graph is run with ONNX Runtime on the evaluation photos and compared with
PyTorch: max abs logit difference and top-1 agreement; the export fails beyond tolerance.
A manifest beside the model records what it was built from (weights, photos, labels, code),
so a second run with the same inputs does nothing; ``force`` rebuilds.
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

log = logging.getLogger(__name__)

OPSET = 17
EXPORTER_VERSION = 1  # bump when the export changes what it writes
SEED = 0
# FP32 ONNX Runtime vs PyTorch logits on the evaluation photos. Seen: a few 1e-5 (the
# graphs fuse BatchNorm into the convolutions and sum in a different order).
MAX_ABS_DIFF = 1e-3
LABELS = Path(__file__).resolve().parent / "data" / "imagenet_labels.txt"
# Sources whose changes change the exported model (the calibration pixels go through the
# served preprocessing): hashed into the manifest as the code version.
CODE_FILES = (
    Path(__file__),
    Path(__file__).resolve().parent / "resnet.py",
    Path(__file__).resolve().parent / "image_data.py",
    Path(__file__).resolve().parent.parent / "python_backends" / "image" / "preprocess.py",
)


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


def paths(repo: Path) -> tuple[Path, Path]:
    """(model.onnx of image_classifier, labels.txt of image_postprocess)."""
    return repo / "image_classifier" / "1" / "model.onnx", repo / "image_postprocess" / "1" / "labels.txt"



def _manifest_path(model_path: Path) -> Path:
    return model_path.with_suffix(".export.json")


def source_fingerprint(weights: Path | None = None) -> dict:
    import torch

    code = hashlib.sha256()
    for path in CODE_FILES:
        code.update(path.read_bytes())
    weights_entry = {"sha256": sha256_file(Path(weights))} if weights is not None else {"random_init_seed": SEED, "torch": torch.__version__}
    return {
        "weights": weights_entry,
        "labels_sha256": sha256_file(LABELS),
        "photos": image_data.fingerprint(),
        "code_sha256": code.hexdigest(),
        "opset": OPSET,
        "exporter_version": EXPORTER_VERSION,
    }


def recorded_manifest(repo: Path) -> dict | None:
    """The export manifest, if the model and labels on disk are the ones it describes."""
    model_path, labels_path = paths(repo)
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


def up_to_date(repo: Path, weights: Path | None = None) -> bool:
    """True when the exported model matches the sources. Without ``weights``, a model exported
    earlier from a checkpoint (--weights) counts as up to date: a plain `make serve` or
    `make test` must never swap a user's trained weights for the random initialisation
    (``--force`` without --weights does that on purpose)."""
    recorded = recorded_manifest(repo)
    if recorded is None:
        return False
    source = recorded.get("source", {})
    if weights is None and "sha256" in source.get("weights", {}):
        current = source_fingerprint(None)
        same_code = all(source.get(k) == current[k] for k in ("labels_sha256", "code_sha256", "opset", "exporter_version"))
        if not same_code:
            log.warning("image_classifier: the exporter changed since the checkpoint was exported; "
                        "re-export with --weights to rebuild it (keeping the trained model for now)")
        return True
    return source == source_fingerprint(weights)


def _calibration_batches(size: int = 16):
    import torch

    pixels = image_data.pixel_values(image_data.calibration_set())
    return [torch.from_numpy(b) for b in image_data.batches(pixels, size)]


@lru_cache(maxsize=2)
def load_torch_model(weights: Path | None = None):
    """The eval-mode PyTorch model and its metadata (cached: tests export more than once)."""
    from export import resnet

    calibration = None if weights is not None else _calibration_batches()
    return resnet.build(weights=weights, seed=SEED, calibration=calibration)


def torch_logits(model, pixels: np.ndarray, batch_size: int = 16) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return np.concatenate([model(torch.from_numpy(b)).numpy() for b in image_data.batches(pixels, batch_size)])


def _export_onnx(model, path: Path, provenance: str = "") -> None:
    import onnx
    import torch

    tmp = path.with_suffix(".onnx.tmp")
    dummy = torch.from_numpy(image_data.pixel_values(image_data.evaluation_set()[:2]))
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


def check_parity(model_path: Path, model=None) -> Parity:
    """ONNX Runtime vs PyTorch on the evaluation photos."""
    if model is None:
        model, _ = load_torch_model()
    pixels = image_data.pixel_values(image_data.evaluation_set())
    return compare(torch_logits(model, pixels), ort_logits(model_path, pixels))


def export(repo: Path, force: bool = False, weights: Path | None = None) -> ExportResult:
    started = time.perf_counter()
    weights = None if weights is None else Path(weights).resolve()
    model_path, labels_path = paths(repo)
    if not force and up_to_date(repo, weights):
        recorded = json.loads(_manifest_path(model_path).read_text())
        log.info("image_classifier: up to date (%s, weights %s); --force to rebuild", model_path, recorded.get("provenance"))
        return ExportResult(model_path, True, None, time.perf_counter() - started, provenance=recorded.get("provenance"))

    model_path.parent.mkdir(parents=True, exist_ok=True)
    labels_path.parent.mkdir(parents=True, exist_ok=True)
    if weights is None:
        log.info("image_classifier: [1/4] ResNet-50, random init (seed %d), BatchNorm statistics re-estimated on %d photos",
                 SEED, len(image_data.calibration_set()))
    else:
        log.info("image_classifier: [1/4] ResNet-50 with weights from %s", weights)
    model, meta = load_torch_model(weights)
    log.info("image_classifier: [2/4] exporting to ONNX (opset %d, FP32)", OPSET)
    _export_onnx(model, model_path, meta["provenance"])
    log.info("image_classifier: [3/4] checking ONNX Runtime against PyTorch on %d evaluation images", len(image_data.evaluation_set()))
    parity = check_parity(model_path, model)
    log.info("image_classifier: max abs logit diff = %.2e (limit %.0e), top-1 agreement %.1f%% of %d",
             parity.max_abs_diff, MAX_ABS_DIFF, 100 * parity.top1_agreement, parity.images)
    if not parity.max_abs_diff <= MAX_ABS_DIFF or parity.top1_disagreements:
        model_path.unlink(missing_ok=True)
        _manifest_path(model_path).unlink(missing_ok=True)
        raise RuntimeError(
            f"image_classifier: ONNX differs from PyTorch (max abs logit diff {parity.max_abs_diff:.2e}, limit "
            f"{MAX_ABS_DIFF:.0e}; {parity.top1_disagreements} top-1 disagreements beyond ties); export rejected"
        )
    log.info("image_classifier: [4/4] copying labels to %s", labels_path)
    shutil.copyfile(LABELS, labels_path)
    manifest = {
        "model": "image_classifier",
        "provenance": meta["provenance"],
        "weights": meta,
        "source": source_fingerprint(weights),
        "model_sha256": sha256_file(model_path),
        "labels_sha256": sha256_file(labels_path),
        "max_abs_diff": parity.max_abs_diff,
        "max_abs_diff_limit": MAX_ABS_DIFF,
        "top1_agreement": parity.top1_agreement,
        "evaluation_images": parity.images,
    }
    _manifest_path(model_path).write_text(json.dumps(manifest, indent=2) + "\n")
    seconds = time.perf_counter() - started
    log.info("image_classifier: wrote %s (%.1f MB) in %.1f s", model_path, model_path.stat().st_size / 1e6, seconds)
    if weights is None:
        log.warning("image_classifier: weights are %s, not trained: served labels are not meaningful "
                    "(pass --weights resnet50.pth for a real model)", meta["provenance"])
    return ExportResult(model_path, False, parity.max_abs_diff, seconds, parity.top1_agreement, meta["provenance"])


# ---- precision variants (export/pipeline.py) -------------------------------------------


class ImageClassifierPipeline:
    """ResNet-50 in every precision, gated on top-1 agreement and probability difference
    against the FP32 PyTorch model on the evaluation photos (export/gates.toml)."""

    name = "image_classifier"
    variants = ("cpu_opt", "int8", "fp16", "ort_trt_fp16", "trt_plan")
    builder_version = 1
    bench_batches = (1, 4, 16)
    # TensorRT profile: batch 1..32 (max_batch_size).
    trt_profiles = {"pixel_values": ((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))}

    def __init__(self, weights: Path | None = None):
        self.weights = None if weights is None else Path(weights).resolve()
        self._reference: np.ndarray | None = None
        self._pixels: np.ndarray | None = None

    def export_fp32(self, repo: Path, force: bool) -> ExportResult:
        result = export(repo, force=force, weights=self.weights)
        recorded = recorded_manifest(repo) or {}
        self.provenance = recorded.get("provenance", result.provenance)
        return result

    def config_parameters(self) -> dict[str, str]:
        """Put where the weights came from into every served config (model metadata)."""
        return {"weights_provenance": getattr(self, "provenance", None) or "unknown"}

    def describe(self) -> dict:
        _, meta = load_torch_model(self.weights)
        real = self.weights is not None
        return {
            "summary": ("ResNet-50, weights from " + self.weights.name if real else
                        f"ResNet-50, {meta['provenance']} (NOT trained: labels are meaningless)")
            + f"; parity on {len(image_data.evaluation_set())} evaluation images (export/image_data.py)",
            "weights": meta["provenance"],
        }

    def ungated_reason(self, variant: str) -> str | None:
        """INT8 with random weights is built and measured, but not gated nor served."""
        if variant == "int8" and self.weights is None:
            # An untrained network's top two logits are a median 0.12 apart, below INT8's
            # noise: top-1 agreement (66 % measured) says nothing about a trained model's loss.
            return ("random-init weights: top-1 margins of an untrained network are below INT8 noise, so its "
                    "top-1 gate is only meaningful with a trained checkpoint (--weights)")
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
            image_quant.quantize_int8(fp32, dst)
        elif variant == "fp16":
            image_quant.fp16(fp32, dst)
        elif variant == "trt_plan":
            from export.pipeline import build_trt_plan

            build_trt_plan(fp32, dst, self.trt_profiles)
        else:
            raise ValueError(f"image_classifier has no builder for variant {variant!r}")

    def _runner(self, variant: str, path: Path):
        from export.pipeline import variant_runner

        run = variant_runner(variant, path, "logits")
        return lambda pixels: run({"pixel_values": pixels})

    def evaluate(self, variant: str, path: Path) -> dict:
        from export.image_quant import agreement

        if self._reference is None:
            model, _ = load_torch_model(self.weights)
            self._pixels = image_data.pixel_values(image_data.evaluation_set())
            self._reference = torch_logits(model, self._pixels)
        run = self._runner(variant, path)
        logits = np.concatenate([np.asarray(run(b), dtype=np.float32) for b in image_data.batches(self._pixels, 16)])
        return agreement(self._reference, logits)

    def bench_feed(self, batch: int) -> dict[str, np.ndarray]:
        pixels = image_data.pixel_values(image_data.evaluation_set()[:batch])
        return {"pixel_values": np.ascontiguousarray(np.resize(pixels, (batch, *pixels.shape[1:])))}
