"""Precision variants of the text encoder: a CPU-optimised FP32 graph, INT8 for CPUs, FP16 for GPUs.

The pipeline is ``model.onnx`` (the plain export) -> :func:`optimize_for_cpu` -> :func:`quantize_int8`,
and separately ``model.onnx`` -> :func:`fp16` for GPUs. Gates, per held-out text (worst text, not
the mean), pooled embedding against the FP32 PyTorch reference: INT8 >= 0.99, FP16 >= 0.999
(:func:`cosines_vs_reference`; texts from ``export.texts.heldout_texts()``).

Recipes measured (2026-11-30, ONNX Runtime 1.32 CPU, AVX-512 VNNI, 2 intra-op threads, spinning off;
83 held-out texts, each scored in three batchings: alone padded to its sequence bucket, grouped by
bucket as served, and mixed batches of 16 padded to the longest; min/mean over all three; speed =
in-process sequences/s of 16-token inputs against the plain FP32 export, measured side by side and
interleaved in one run, median of the per-round ratios. The box is a shared, noisy 2-core VM:
speed ratios moved by +-0.3 between runs, so read them as bands.)

| recipe | min cos | mean cos | speed b=1 | speed b=32 |
| --- | --- | --- | --- | --- |
| FP32 export (baseline) | 1.0000 | 1.0000 | 1.00 | 1.00 |
| optimize_for_cpu: ORT BERT fusions, FP32 | 1.0000 | 1.0000 | 1.07 | 0.96 |
| quantize_dynamic defaults, plain export (also 8-bit word embeddings) | 0.780 | 0.931 | 2.18 | 2.45 |
| quantize_dynamic per_channel, plain export | 0.967 | 0.989 | 2.00 | 2.41 |
| optimised + quantize_dynamic defaults (QAttention, QEmbedLayerNormalization) | 0.779 | 0.932 | 2.15 | 2.25 |
| optimised + per_channel, MatMul + Attention (QAttention) | 0.963 | 0.989 | 2.01 | 2.23 |
| same + reduce_range | 0.958 | 0.987 | 1.97 | 2.24 |
| optimised + per_channel, Attention (QKV) kept FP32 | 0.973 | 0.991 | 1.65 | 1.67 |
| SmoothQuant-style scaling alpha 0.7 (0.5: 0.954, 0.85: 0.931) + per_channel | 0.979 | 0.994 | 1.88 | 2.12 |
| 32 outlier channels in FP32 + Attention smoothing 0.4, per-tensor activations | 0.993 | 0.998 | 1.52 | 1.74 |
| static QDQ per-channel, MinMax calibration (Entropy: identical) | 0.800 | 0.908 | 1.62 | 2.09 |
| static QDQ per-channel, Percentile 99.999 | 0.741 | 0.919 | - | - |
| MatMulNBits 8-bit, block 32, accuracy_level 4 (int8 compute), Attention FP32 | 0.999 | 1.000 | 1.25 | 1.07 |
| MatMulNBits 8-bit, block 128, Attention FP32 | 0.997 | 0.999 | 1.42 | 1.23 |
| MatMulNBits 8-bit, block 64, all 24 MatMuls (QKV unfused) | 0.997 | 0.999 | 1.41 | 1.17 |
| MatMulNBits 4-bit, block 32 | 0.870 | 0.953 | - | - |
| per-token + outlier split on all 24 MatMuls | 0.997 | 0.999 | 1.32 | 1.57 |
| per-token, outliers duplicated at 1/c (channel splitting) instead of FP32 | 0.992 | 0.998 | 0.87 | 0.99 |
| **chosen: per-token where LayerNorm-fed, 8 outlier channels FP32** | **0.997** | **0.999** | **1.47** | **1.70** |
| fp16() of the plain export, run on CPU (gate >= 0.999) | 0.999998 | 0.999999 | 0.93 | 0.97 |

Speed figures are one side-by-side run of all rows. Across six runs the chosen recipe's median was
1.4-2.1x at batch 1 and 1.7-2.1x at batch 32, the failing per_channel dynamic recipe's 2.0-2.7x:
the chosen one trades about a fifth of the naive speed-up for a worst text of 0.997 instead of 0.96.
It is the fastest recipe that passes; the 32-channel per-tensor variant is as fast but only 0.992
on the calibration texts, and MatMulNBits (needs the ``onnx_ir`` package) is accurate but slow.
Size: 59 MB against 90 MB; the 47 MB word-embedding table stays FP32.

Why the naive recipes fail. Worst texts are always the short ones ("no", "!!!", "Thanks") whose
pooled embedding is dominated by [CLS]/[SEP]/punctuation: "attention sink" tokens that carry one or
two huge channels (channel 99 reaches 28 against a median of 1.8 in LayerNorm outputs). LayerNorm
then squashes the rest of such a token, and a per-tensor activation scale sized for channel 99 leaves
those small values a handful of quantisation steps. Weight-only per-channel INT8 alone measured
0.995 worst; activation quantisation is the larger loss (0.96). Per-channel weights, reduce_range,
SmoothQuant-style scaling and keeping nodes FP32 stayed below 0.99 or gave up the speed-up; static
QDQ is worse still (one calibrated range cannot fit both kinds of token); taking outlier channels out
of the quantised path helps but per-tensor scales still leave the sink tokens short (0.992).

The chosen recipe ("per-token + outlier split") fixes that at the source with stock ONNX Runtime
operators (standard ops and the ``com.microsoft`` contrib ops MultiHeadAttention,
MatMulIntegerToFloat, DynamicQuantizeMatMul; no custom ops):

- the fused Attention's QKV projection becomes one plain MatMul (+ Split + MultiHeadAttention) so it
  can be quantised; the attention core stays FP32 (as in QAttention);
- for MatMuls fed by a LayerNorm or by GELU, the ``OUTLIER_CHANNELS`` (8) input channels with the
  largest calibrated magnitude (calibration_texts(), disjoint from the held-out texts) bypass
  quantisation: a small FP32 MatMul over those channels is added back (LLM.int8()-style);
- MatMuls fed by a LayerNorm (QKV projection, FFN input) quantise activations per token: each row is
  divided by its own max before a fixed-scale u8 quantisation, and the output row multiplied back;
- MatMuls fed by GELU (FFN output) and by attention (attention output) keep ORT's dynamic per-tensor
  quantisation (the former with the outlier split);
- weights: symmetric int8, one scale per output column.

Deterministic for a given model and ONNX Runtime build (calibration is a max over fixed texts). The
u8 x s8 integer GEMM is exact on VNNI CPUs (AVX512-VNNI, AVX-VNNI); on AVX2-only CPUs ORT's u8s8
kernel adds pairs of products in int16 with saturation, so there the weights get 7 bits (+-63,
:func:`weight_levels`), as ``reduce_range`` does (measured 2026-12-02 on an AVX2-only AMD EPYC: worst
text 0.9866 with 8-bit weights, a gate failure, 0.9939 with 7-bit; u8 x u8 weights would also avoid
it but measured 1.3-1.6x slower). The choice is the exporting CPU's; an export moved to a CPU of
the other kind rebuilds (the pipeline's builder_version names it). Calibration and weights use ORT 1.32; the served
ORT must know MultiHeadAttention on CPU with a 1-D key padding mask (not checked on older builds).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from export import reference
from export.texts import calibration_texts

log = logging.getLogger(__name__)

NUM_HEADS = 12
HIDDEN_SIZE = reference.HIDDEN_SIZE
NUM_LAYERS = 6
OUTLIER_CHANNELS = 8
OUTPUT = "sentence_embedding"  # export.text_encoder.OUTPUT
INT8_MIN_COSINE = 0.99
FP16_MIN_COSINE = 0.999
MS_DOMAIN = "com.microsoft"
# ONNX Runtime's x86 u8 x s8 GEMM without VNNI (AVX2 only) adds pairs of products in int16 with
# saturation: 255 x 127 x 2 overflows it. Weights of 7 bits (+-63) keep every pair in range (what
# quantize_dynamic's reduce_range does); with VNNI (AVX512-VNNI, AVX-VNNI) the full 8 bits are exact.
FULL_WEIGHT_LEVELS = 127
REDUCED_WEIGHT_LEVELS = 63

_LAYERNORM_OPS = {"LayerNormalization", "SkipLayerNormalization", "EmbedLayerNormalization"}
_GELU_OPS = {"BiasGelu", "Gelu", "FastGelu"}


def optimize_for_cpu(src: Path, dst: Path) -> None:
    """ONNX Runtime's BERT fusions (EmbedLayerNormalization, Attention, SkipLayerNormalization,
    BiasGelu) on the plain export, FP32, no GPU-only fusions, written to ``dst``.

    Raises RuntimeError when the attention layers did not fuse (the export changed shape).
    """
    import onnx

    model = _fuse(onnx.load(str(src)), multi_head=False)
    _save(model, dst)


def quantize_int8(src: Path, dst: Path) -> None:
    """The chosen INT8 recipe (module docstring) applied to ``src``, written to ``dst``.

    ``src`` is the output of :func:`optimize_for_cpu`; a plain export is optimised first.
    """
    import onnx

    model = onnx.load(str(src))
    if not any(n.op_type == "Attention" for n in model.graph.node):
        model = _fuse(model, multi_head=False)
    qkv = _unfuse_qkv_projection(model)
    maxima = _calibrate(model, calibration_texts())
    levels = weight_levels()
    counts = _quantize_matmuls(model, maxima, levels)
    kinds = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    log.info(
        "int8: %d MatMuls quantised (%s; %d outlier channels), %d QKV projections unfused; weights +-%d (%s)",
        sum(counts.values()),
        kinds,
        OUTLIER_CHANNELS,
        qkv,
        levels,
        "VNNI CPU" if levels == FULL_WEIGHT_LEVELS else "no VNNI: 7-bit weights against int16 saturation",
    )
    _save(model, dst)


def fp16(src: Path, dst: Path) -> None:
    """FP16 weights and compute for GPUs; int64 inputs and the float32 output are kept.

    Works on the plain export (standard ops: what TensorRT parses) or on the optimised graph.
    Constants beyond FP16's range (the export's attention mask uses float32's lowest value) are
    clamped by the converter, so the mask stays finite.
    """
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    _save(model, dst)


def cosines_vs_reference(model_path: Path, texts: Sequence[str], batch_size: int = 16) -> np.ndarray:
    """Per-text cosine of sentence embeddings, ONNX Runtime on CPU vs the FP32 PyTorch reference.

    Texts run in batches of ``batch_size`` padded to the longest, like ``reference.embed``; the
    graph pools (masked mean, L2) as the reference does.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    texts = list(texts)
    pooled = []
    for start in range(0, len(texts), batch_size):
        ids, mask = reference.tokenize(texts[start : start + batch_size])
        (embedding,) = session.run([OUTPUT], {"input_ids": ids, "attention_mask": mask})
        pooled.append(embedding)
    return reference.cosine_rows(np.concatenate(pooled), reference.embed(texts, batch_size=batch_size))


# --- graph surgery -------------------------------------------------------------------------


def _save(model, dst: Path) -> None:
    import onnx

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    onnx.save(model, str(tmp))
    tmp.replace(dst)
    ops = Counter(n.op_type for n in model.graph.node)
    top = ", ".join(f"{k} {v}" for k, v in ops.most_common(8))
    log.info("wrote %s (%.1f MB): %s", dst, dst.stat().st_size / 1e6, top)


def _scale_mul_to_div(model) -> int:
    """transformers 5's eager attention multiplies the scores by 1/sqrt(d); ORT's BERT fusion
    looks for the division transformers 4 used, and would take the scale Mul for the mask Mul.
    Rewrite ``Mul(scores, c)`` before Softmax as ``Div(scores, 1/c)`` (same value in FP32)."""
    from onnx import helper, numpy_helper
    from onnxruntime.transformers.onnx_model import OnnxModel

    graph = OnnxModel(model)
    producers = graph.output_name_to_node()
    rewritten = 0
    for softmax in graph.get_nodes_by_op_type("Softmax"):
        path = graph.match_parent_path(softmax, ["Add", "Mul", "MatMul"], [0, None, 0], producers)
        if path is None:
            continue
        mul = path[1]
        scale = graph.get_constant_value(mul.input[1])
        if scale is None or np.size(scale) != 1:
            continue
        divisor = np.array(1.0 / float(np.ravel(scale)[0]), dtype=np.float32)
        divisor = numpy_helper.from_array(divisor, mul.name + "_divisor")
        graph.add_initializer(divisor)
        graph.remove_node(mul)
        div = helper.make_node("Div", [mul.input[0], divisor.name], list(mul.output), name=mul.name + "_as_div")
        graph.add_node(div)
        rewritten += 1
    graph.topological_sort()
    return rewritten


def _fuse(model, multi_head: bool):
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    rewritten = _scale_mul_to_div(model)
    options = FusionOptions("bert")
    options.use_multi_head_attention = multi_head
    # opt_level=0: only the transformer fusions; ONNX Runtime applies its own, machine-specific
    # graph optimisations when a session loads the file.
    optimized = optimize_model(
        model,
        model_type="bert",
        num_heads=NUM_HEADS,
        hidden_size=HIDDEN_SIZE,
        optimization_options=options,
        opt_level=0,
        use_gpu=False,
    )
    fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    log.info("optimize: %d attention scale Mul(s) rewritten; fused %s", rewritten, fused)
    attention = fused.get("MultiHeadAttention" if multi_head else "Attention", 0)
    if attention != NUM_LAYERS:
        raise RuntimeError(f"optimize: {attention} of {NUM_LAYERS} attention layers fused; the export's graph changed")
    return optimized.model


def _unfuse_qkv_projection(model) -> int:
    """Attention(x, W, b, mask) -> MatMul(x, W) -> Split -> MultiHeadAttention(q, k, v, b, mask):
    the same computation, with the QKV projection as a MatMul that can be quantised."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    nodes, count = [], 0
    for node in model.graph.node:
        if node.op_type != "Attention" or node.domain != MS_DOMAIN:
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        unsupported = set(attrs) - {"num_heads", "mask_filter_value", "scale"}
        if unsupported or len(node.input) > 4 or node.input[1] not in inits:
            raise RuntimeError(f"int8: cannot unfuse {node.name}: attributes {sorted(unsupported)}, {node.input}")
        hidden = numpy_helper.to_array(inits[node.input[1]]).shape[1] // 3
        base = node.name + "_qkv"
        sizes = numpy_helper.from_array(np.array([hidden] * 3, np.int64), base + "_sizes")
        model.graph.initializer.append(sizes)
        qkv = [f"{base}_{part}" for part in ("q", "k", "v")]
        nodes.append(helper.make_node("MatMul", [node.input[0], node.input[1]], [base], name=base + "_projection"))
        nodes.append(helper.make_node("Split", [base, sizes.name], qkv, name=base + "_split", axis=-1))
        mask = [node.input[3]] if len(node.input) > 3 and node.input[3] else []
        nodes.append(
            helper.make_node(
                "MultiHeadAttention", qkv + [node.input[2]] + mask, list(node.output), name=node.name, domain=MS_DOMAIN, **attrs
            )
        )
        count += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return count


def _weight_matmuls(model) -> list:
    inits = {i.name for i in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]


def _calibrate(model, texts: Sequence[str]) -> dict[str, np.ndarray]:
    """Per input channel, the largest |activation| entering each weight MatMul over ``texts``
    (each text alone, unpadded)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    taps = {n.name: n.input[0] for n in _weight_matmuls(probe)}
    outputs = {o.name for o in probe.graph.output}
    for tensor in sorted(set(taps.values()) - outputs):
        probe.graph.output.append(helper.make_tensor_value_info(tensor, TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # reproducible reductions
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    maxima: dict[str, np.ndarray] = {}
    for text in texts:
        ids, mask = reference.tokenize([text])
        values = dict(zip(names, session.run(None, {"input_ids": ids, "attention_mask": mask})))
        for node, tensor in taps.items():
            x = np.abs(values[tensor]).reshape(-1, values[tensor].shape[-1]).max(axis=0)
            maxima[node] = np.maximum(maxima.get(node, 0.0), x)
    return maxima


def cpu_has_vnni(cpuinfo: str | None = None) -> bool:
    """Whether this x86 CPU has the VNNI dot-product instructions ONNX Runtime's INT8 GEMM uses
    (Linux /proc/cpuinfo flags). Other architectures (ARM's dot products) do not saturate: True."""
    import platform

    if cpuinfo is None:
        if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
            return True
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False  # unknown x86 CPU: the safe range
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return bool(flags & {"avx512_vnni", "avx_vnni", "avx_vnni_int8"})


def weight_levels(has_vnni: bool | None = None) -> int:
    """Largest |int8 weight| of the recipe on this CPU: 127 with VNNI, else 63 (module constants)."""
    if has_vnni is None:
        has_vnni = cpu_has_vnni()
    return FULL_WEIGHT_LEVELS if has_vnni else REDUCED_WEIGHT_LEVELS


def _quantize_matmuls(model, maxima: dict[str, np.ndarray], levels: int | None = None) -> Counter:
    from onnx import helper, numpy_helper

    if levels is None:
        levels = weight_levels()
    inits = {i.name: i for i in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    nodes: list[Any] = []
    counts: Counter[str] = Counter()

    def const(array: np.ndarray, name: str) -> str:
        model.graph.initializer.append(numpy_helper.from_array(array, name))
        return name

    def add(op: str, inputs: list[str], output: str, name: str, **kwargs) -> None:
        nodes.append(helper.make_node(op, inputs, [output], name=name, **kwargs))

    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits:
            nodes.append(node)
            continue
        n, x, y = node.name, node.input[0], node.output[0]
        source = producers.get(x)
        per_token = source is not None and source.op_type in _LAYERNORM_OPS
        split = per_token or (source is not None and source.op_type in _GELU_OPS)
        counts["per-token + outliers" if per_token else "per-tensor + outliers" if split else "per-tensor"] += 1
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)

        if split:
            # The largest input channels go around the integer GEMM in FP32; their weight rows
            # are zeroed in the quantised matrix so that they cost nothing there.
            outliers = np.sort(np.argsort(maxima[n])[-OUTLIER_CHANNELS:]).astype(np.int64)
            keep = np.ones(w.shape[0], np.float32)
            keep[outliers] = 0.0
            add("Gather", [x, const(outliers, n + "_outlier_channels")], n + "_outliers_x", n + "_outliers", axis=-1)
            add(
                "MatMul", [n + "_outliers_x", const(w[outliers], n + "_outlier_weight")], n + "_outliers_y", n + "_outlier_matmul"
            )
            add("Mul", [x, const(keep, n + "_inlier_mask")], n + "_inliers_x", n + "_inliers")
            x, y = n + "_inliers_x", n + "_inliers_y"
            w = w * keep[:, None]

        scale = np.maximum(np.abs(w).max(axis=0), 1e-12) / levels
        wq = const(np.clip(np.round(w / scale), -levels, levels).astype(np.int8), n + "_weight_int8")
        ws = const(scale.astype(np.float32), n + "_weight_scale")
        wz = const(np.zeros(scale.shape, np.int8), n + "_weight_zero_point")
        if per_token:
            # Rows scaled to max |x| = 1, then one fixed scale: per-token quantisation from stock ops.
            xs = const(np.array(1 / 127, np.float32), n + "_x_scale")
            xz = const(np.array(128, np.uint8), n + "_x_zero_point")
            add("Abs", [x], n + "_abs", n + "_abs")
            add("ReduceMax", [n + "_abs"], n + "_rowmax", n + "_rowmax", axes=[-1], keepdims=1)
            floor = const(np.array(1e-12, np.float32), n + "_floor")  # an all-zero row must not give 0/0
            add("Max", [n + "_rowmax", floor], n + "_row_scale", n + "_row_scale")
            add("Div", [x, n + "_row_scale"], n + "_normalised", n + "_normalise")
            add("QuantizeLinear", [n + "_normalised", xs, xz], n + "_x_uint8", n + "_quantize")
            add("MatMulIntegerToFloat", [n + "_x_uint8", wq, xs, ws, xz, wz], n + "_normalised_y", n + "_int8", domain=MS_DOMAIN)
            add("Mul", [n + "_normalised_y", n + "_row_scale"], y, n + "_denormalise")
        else:
            add("DynamicQuantizeMatMul", [x, wq, ws, wz], y, n + "_int8", domain=MS_DOMAIN)
        if split:
            add("Add", [y, n + "_outliers_y"], node.output[0], n + "_merge")

    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {i for n in model.graph.node for i in n.input}
    initializers = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return counts
