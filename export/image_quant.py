"""INT8 and FP16 variants of the exported image classifiers, and how far each moves from FP32.

* ``quantize_int8``: ONNX Runtime **static** quantization in QDQ format, weights per channel,
  activations calibrated on the calibration photos (export/image_data.py) through a
  ``CalibrationDataReader`` that feeds the served preprocessing's pixels; biases corrected for
  the weights' rounding on the same photos; 7-bit weights on x86 CPUs without VNNI. For CPUs.
* ``fp16``: FP16 weights and activations with FP32 inputs and outputs, for GPUs (on a CPU
  ONNX Runtime emulates most FP16 kernels with casts and is slower; evaluated here only for
  its accuracy).

``python -m export.image_quant`` builds both from the exported FP32 model and prints top-1
agreement and the largest probability difference against FP32 on the evaluation photos,
and in-process latency at batch 1 of FP32 and INT8, measured side by side.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from export import image_data
from python_backends.image.postprocess import softmax

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
INPUT = "pixel_values"
OUTPUT = "logits"


class PhotoCalibrationReader:
    """onnxruntime.quantization.CalibrationDataReader over preprocessed photos, in batches."""

    def __init__(self, pixels: np.ndarray, batch_size: int = 8, input_name: str = INPUT):
        self._batches = [{input_name: b} for b in image_data.batches(np.ascontiguousarray(pixels, dtype=np.float32), batch_size)]
        self._next = iter(self._batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._next, None)

    def rewind(self) -> None:
        self._next = iter(self._batches)


def quantize_int8(
    src: Path,
    dst: Path,
    calibration: np.ndarray | None = None,
    method: str = "MinMax",
    bias_correction: bool = True,
    has_vnni: bool | None = None,
) -> None:
    """Static QDQ INT8 (uint8 activations, per-channel int8 weights) calibrated on
    ``calibration`` pixels [n, 3, 224, 224] (default: the calibration photos).

    Weights get 8 bits on CPUs with VNNI and 7 (``reduce_range``) on x86 CPUs without it
    (export.text_quant.cpu_has_vnni): ONNX Runtime's u8 x s8 kernels there add pairs of products
    in saturating int16. With ``bias_correction`` each Conv/Gemm bias absorbs the mean shift
    its weight rounding causes on the calibration pixels (:func:`correct_biases`)."""
    import tempfile

    from onnxruntime.quantization.shape_inference import quant_pre_process

    from export.text_quant import cpu_has_vnni

    if calibration is None:
        calibration = image_data.pixel_values(image_data.calibration_set())
    if has_vnni is None:
        has_vnni = cpu_has_vnni()

    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="image-quant-") as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        # Shape inference and ORT's graph optimisations first, as ORT recommends for static
        # quantization (the export already folded BatchNorm into the convolutions).
        quant_pre_process(str(src), str(prepared), skip_symbolic_shape=True)
        _name_nodes(prepared)
        if bias_correction:
            first = Path(tmp) / "first.onnx"
            _quantize_static(prepared, first, calibration, method, reduce_range=not has_vnni)
            corrected = Path(tmp) / "corrected.onnx"
            correct_biases(prepared, first, corrected, calibration)
            prepared = corrected
        _quantize_static(prepared, dst, calibration, method, reduce_range=not has_vnni)


def _name_nodes(path: Path) -> None:
    """Give every node a unique name: the quantized graph's nodes are matched to the float
    graph's by name (ONNX Runtime's quantizer keeps them)."""
    import onnx

    model = onnx.load(str(path))
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)
    onnx.save(model, str(path))


def _quantize_static(src: Path, dst: Path, calibration: np.ndarray, method: str, reduce_range: bool) -> None:
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static

    class Reader(PhotoCalibrationReader, CalibrationDataReader):
        pass

    quantize_static(
        str(src),
        str(dst),
        Reader(calibration),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        # U8S8: unsigned activations, signed weights. With S8S8 ONNX Runtime 1.32 fused
        # only 33 of the 53 convolutions of ResNet-50 into QLinearConv (the residual Adds
        # stayed float, with layout transposes around them). U8U8 weights avoid the int16
        # saturation of CPUs without VNNI but run slower than FP32 there (docs/image-pipeline.md).
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        reduce_range=reduce_range,
        calibrate_method=getattr(CalibrationMethod, method),
    )


def _dequantized_weights(quantized) -> dict[str, np.ndarray]:
    """{node name: the weights its DequantizeLinear feeds it} of a QDQ graph's Conv and Gemm nodes."""
    from onnx import numpy_helper

    inits = {t.name: numpy_helper.to_array(t) for t in quantized.graph.initializer}
    producers = {o: n for n in quantized.graph.node for o in n.output}
    weights = {}
    for node in quantized.graph.node:
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 2:
            continue
        dq = producers.get(node.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        q = inits[dq.input[0]].astype(np.float64)
        scale = inits[dq.input[1]].astype(np.float64)
        zero = inits[dq.input[2]].astype(np.float64) if len(dq.input) > 2 and dq.input[2] else np.zeros_like(scale)
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        shape = [1] * q.ndim
        if scale.ndim:
            shape[axis] = -1
        weights[node.name] = (q - zero.reshape(shape)) * scale.reshape(shape)
    return weights


def input_means(model, names: Sequence[str], pixels: np.ndarray, batch_size: int = 8) -> dict[str, np.ndarray]:
    """Per-channel means of the tensors ``names`` (axis 1; the other axes averaged) over ``pixels``."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    outputs = {o.name for o in probe.graph.output}
    for name in names:
        if name not in outputs:
            probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(probe.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"])
    sums: dict[str, float | np.ndarray] = {name: 0.0 for name in names}  # per-channel ndarrays after the first batch
    for batch in image_data.batches(np.ascontiguousarray(pixels, dtype=np.float32), batch_size):
        for name, value in zip(names, session.run(list(names), {INPUT: batch})):
            axes = tuple(i for i in range(value.ndim) if i != 1)
            sums[name] = sums[name] + value.astype(np.float64).mean(axis=axes) * len(batch)
    return {name: np.asarray(total / len(pixels)) for name, total in sums.items()}


def correct_biases(float_path: Path, quantized_path: Path, dst: Path, calibration: np.ndarray) -> int:
    """Write ``float_path`` with each Conv/Gemm bias corrected for its weights' rounding in
    ``quantized_path`` (the same graph, quantized): b -= (W_q - W) applied to the mean input
    channel over the calibration pixels, so rounding no longer shifts the mean output (empirical
    bias correction, Nagel et al. 2019, "Data-Free Quantization"). Quantizing the result again
    rounds the weights alike, but for the channels with small weights and a large bias
    whose weight scale ONNX Runtime widens so that the int32 bias fits. Returns the number of
    corrected nodes."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(float_path))
    dequantized = _dequantized_weights(onnx.load(str(quantized_path)))
    inits = {t.name: t for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.name in dequantized and len(n.input) > 2 and n.input[2] in inits]
    means = input_means(model, list(dict.fromkeys(n.input[0] for n in nodes)), calibration)
    for node in nodes:
        weight = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64)
        bias = numpy_helper.to_array(inits[node.input[2]])
        delta = dequantized[node.name] - weight
        mean = means[node.input[0]]
        if node.op_type == "Gemm":
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            shift = delta @ mean if trans_b else mean @ delta
        else:
            group = next((a.i for a in node.attribute if a.name == "group"), 1)
            per_input = delta.sum(axis=tuple(range(2, delta.ndim)))  # [out, in / group]
            per_group = per_input.shape[1]
            # Output channel o reads input channels (o // (out / group)) * per_group + [0, per_group).
            first = (np.arange(delta.shape[0]) // (delta.shape[0] // group)) * per_group
            shift = np.einsum("oi,oi->o", per_input, mean[first[:, None] + np.arange(per_group)])
        inits[node.input[2]].CopyFrom(numpy_helper.from_array((bias - shift).astype(bias.dtype), node.input[2]))
    onnx.save(model, str(dst))
    log.info("int8: bias correction of %d Conv/Gemm nodes on %d calibration images", len(nodes), len(calibration))
    return len(nodes)


def optimize_for_cpu(src: Path, dst: Path) -> None:
    """ONNX Runtime's offline graph optimisation at the EXTENDED level (Conv+BN+ReLU fusions,
    constant folding), saved as a portable ONNX file. Not ALL: that level adds layout
    transformations specific to the CPU that ran it."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), sess_options=options, providers=["CPUExecutionProvider"])
    log.info("cpu_opt: wrote %s (%.1f MB)", dst, dst.stat().st_size / 1e6)


def fp16(src: Path, dst: Path) -> None:
    """FP16 weights and activations, FP32 ``pixel_values`` in and ``logits`` out."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))


def run_logits(path: Path, pixels: np.ndarray, batch_size: int = 16, threads: int = 0) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    return np.concatenate([session.run([OUTPUT], {INPUT: b})[0] for b in image_data.batches(pixels, batch_size)])


# A top-1 class counts as decided when the reference gives it this much more probability than
# the runner-up. Below it the reference itself is split between two classes, and a flip there
# says nothing a user would see as a different answer (docs/image-pipeline.md).
DECIDED_MARGIN = 0.05


def agreement(
    reference_logits: np.ndarray, logits: np.ndarray, labels: np.ndarray | None = None, decided_margin: float = DECIDED_MARGIN
) -> dict:
    """How far ``logits`` move from ``reference_logits`` [n, classes]:

    * top1_agreement: fraction of all images with the reference's top-1 class;
    * decided_top1_agreement: the same over the images whose reference top-1 probability leads
      the runner-up by at least ``decided_margin`` (decided_images of them); absent when none
      is decided (an untrained network), so a gate on it fails;
    * prob_diff: the largest absolute difference of any class probability on any image;
    * with ``labels`` (the true classes): top1_accuracy of ``logits``, reference_top1_accuracy,
      and accuracy_drop = reference_top1_accuracy - top1_accuracy."""
    p_ref, p = softmax(reference_logits), softmax(logits)
    same = reference_logits.argmax(axis=1) == logits.argmax(axis=1)
    top2 = np.sort(p_ref, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) >= decided_margin
    result = {
        "top1_agreement": float(same.mean()),
        "decided_images": int(decided.sum()),
        "prob_diff": float(np.abs(p - p_ref).max()),
        "max_abs_logit_diff": float(np.abs(logits - reference_logits).max()),
        "images": int(len(logits)),
    }
    if decided.any():
        result["decided_top1_agreement"] = float(same[decided].mean())
    if labels is not None:
        labels = np.asarray(labels)
        accuracy = float(np.mean(logits.argmax(axis=1) == labels))
        reference_accuracy = float(np.mean(reference_logits.argmax(axis=1) == labels))
        result.update(
            top1_accuracy=accuracy, reference_top1_accuracy=reference_accuracy, accuracy_drop=reference_accuracy - accuracy
        )
    return result


def latency_ms(paths: dict[str, Path], pixels: np.ndarray, rounds: int = 15, threads: int = 0) -> dict[str, float]:
    """Median batch-1 latency per model, measured in interleaved rounds (A B, A B, ...) so that
    the noise of a shared machine hits every model alike."""
    import onnxruntime as ort

    sessions = {}
    for name, path in paths.items():
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sessions[name] = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    feed = {INPUT: np.ascontiguousarray(pixels[:1])}
    for session in sessions.values():
        session.run([OUTPUT], feed)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(rounds):
        for name, session in sessions.items():
            started = time.perf_counter()
            session.run([OUTPUT], feed)
            times[name].append((time.perf_counter() - started) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def report(fp32_path: Path, out_dir: Path, rounds: int = 15) -> dict:
    """Build INT8 and FP16 from ``fp32_path`` into ``out_dir`` and measure them against it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    int8_path, fp16_path = out_dir / "model.int8.onnx", out_dir / "model.fp16.onnx"
    started = time.perf_counter()
    quantize_int8(fp32_path, int8_path)
    log.info("int8: built in %.1f s (%.1f MB)", time.perf_counter() - started, int8_path.stat().st_size / 1e6)
    fp16(fp32_path, fp16_path)
    pixels = image_data.pixel_values(image_data.evaluation_set())
    labels = image_data.labels(image_data.evaluation_set())
    reference = run_logits(fp32_path, pixels)
    result = {
        "int8": agreement(reference, run_logits(int8_path, pixels), labels),
        "fp16": agreement(reference, run_logits(fp16_path, pixels), labels),
    }
    result["latency_ms_b1"] = latency_ms({"fp32": fp32_path, "int8": int8_path}, pixels, rounds=rounds)
    result["int8_speedup_b1"] = result["latency_ms_b1"]["fp32"] / result["latency_ms_b1"]["int8"]
    result["size_mb"] = {
        n: round(p.stat().st_size / 1e6, 1) for n, p in (("fp32", fp32_path), ("int8", int8_path), ("fp16", fp16_path))
    }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m export.image_quant", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=ROOT / "model_repository" / "image_classifier" / "1" / "model.onnx")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "image_quant")
    parser.add_argument("--rounds", type=int, default=15, help="latency rounds (batch 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not args.model.is_file():
        print(f"{args.model} not found: run `python -m export` first", file=sys.stderr)
        return 1
    result = report(args.model, args.out, rounds=args.rounds)
    (args.out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    print("| variant | top-1 agreement vs FP32 | max prob diff | max abs logit diff | latency b1 (ms) | size MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    lat = result["latency_ms_b1"]
    print(f"| fp32 | 1 | 0 | 0 | {lat['fp32']:.1f} | {result['size_mb']['fp32']} |")
    for name in ("int8", "fp16"):
        r = result[name]
        print(
            f"| {name} | {r['top1_agreement']:.3f} ({r['images']} images) | {r['prob_diff']:.2e} | "
            f"{r['max_abs_logit_diff']:.3f} | {lat.get(name, float('nan')):.1f} | {result['size_mb'][name]} |"
        )
    print(f"INT8 speed-up at batch 1: {result['int8_speedup_b1']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
