"""The engine's forward pass on OpenVINO: the ``ov_*`` variants of ``text_generation``.

Everything the engine adds around the model stays as it is (scheduler, block manager and prefix
cache, sampling, penalties, logit bias, logprobs, guides, ``n`` choices, preemption, speculative
drafts, metrics): :class:`OpenVINORunner` only replaces
:class:`~python_backends.generation.model_runner.ModelRunner`, takes the same plan and returns the
same FP32 logits rows.

The model is OpenVINO GenAI's graph of the exported GGUF (``export/openvino_ir.py``), turned at load
into the paged form OpenVINO GenAI's continuous batching runs (``paged_attention_transformation``):
one ``PagedAttentionExtension`` per layer over K/V cache tensors of ``[blocks, kv heads, block size,
head dim]``, addressed by block tables. Those tables are the block manager's own: a block the prefix
cache shares, a fork's prompt or a copy on write is read from the same physical block, so nothing is
mirrored and no cell is kept beyond what the block manager counts. Each sequence attends over its own
blocks only (``past_lens``, ``block_indices``), so a step costs what its sequences hold, not the pool.
One input is added to the graph: ``logits_indices``, the rows the head computes (the last token of a
prompt chunk, every position of a chunk with a draft), as vLLM's ``logits_indices``.

OpenVINO's CPU plugin picks the cache's element type (BF16 on CPUs with AVX512-BF16 or AMX, else F16)
and its block size (32): the block manager must use the same block size (``block_size`` 32 in the
variant's config).

``ov_int4_f16`` adds a second graph over the same K/V cache for steps of up to :data:`OV_INT4_MAX_ROWS`
tokens (one or two decoding streams), where a step is bound by reading the weights: every layer's
product reads 4-bit blocks of 32 (Q4_1's layout, :func:`~python_backends.generation.linear.int4_blocks`,
so the GGUF's Q4_1 blocks come back exactly), the head 8-bit blocks of 32 (:func:`quantize_int4`, run
by the export). Larger steps run ``ov_f16``'s graph: on two cores OpenVINO's BF16 products beat its
4-bit ones from a few rows.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from contract.errors import ConfigError

log = logging.getLogger(__name__)

# variant -> the GGUF its OpenVINO model is built from (export/openvino_ir.py) and the IR's folder.
OV_PRECISIONS = {"ov_f16": "f16", "ov_int4_f16": "f16"}
OV_BLOCK_SIZE = 32  # the CPU plugin's paged-attention block
# ov_int4_f16: its 4-bit graph runs steps of up to this many tokens (one or two decoding streams),
# where reading 4-bit weights pays; OpenVINO's 4-bit products cost more than its BF16 ones from
# about 4 rows (docs/generation-internals.md#the-openvino-runtime).
OV_INT4_MAX_ROWS = 2
OV_INT4_PRECISIONS = ("ov_int4_f16",)
OV_HEAD_GROUP = 32  # the output head's 8-bit blocks (a scale each)
IR_FILE = "openvino_model.xml"
INT4_IR_FILE = "openvino_model_int4.xml"  # ov_int4_f16's 4-bit graph, beside the F16 one (export/openvino_ir.py)


def ir_dir(model_dir: str | Path, precision: str) -> Path:
    return Path(model_dir) / f"openvino-{OV_PRECISIONS[precision]}"


@dataclass
class OVWeights:
    """The OpenVINO model an ``ov_*`` variant serves, with the exported folder's config.json."""

    config: Any
    path: Path  # openvino_model.xml
    precision: str
    int4_path: Path | None = None  # ov_int4_f16: openvino_model_int4.xml

    def nbytes(self) -> int:
        return sum(p.with_suffix(".bin").stat().st_size for p in (self.path, self.int4_path) if p is not None)

    @classmethod
    def from_folder(cls, folder: str | Path, precision: str) -> OVWeights:
        from python_backends.generation.model_runner import LlamaConfig

        if precision not in OV_PRECISIONS:
            raise ConfigError(f"weights_precision {precision!r}: expected one of {', '.join(OV_PRECISIONS)}")
        path = ir_dir(folder, precision) / IR_FILE
        int4_path = path.with_name(INT4_IR_FILE) if precision in OV_INT4_PRECISIONS else None
        for p in (path, int4_path):
            if p is not None and not (p.is_file() and p.with_suffix(".bin").is_file()):
                raise ConfigError(f"{p} is missing: export it first (python -m export)")
        return cls(LlamaConfig.from_folder(folder), path, precision, int4_path)


def paged_model(xml: Path):
    """OpenVINO GenAI's model as its continuous batching compiles it, plus ``logits_indices``."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino._offline_transformations import paged_attention_transformation

    model = ov.Core().read_model(str(xml))
    paged_attention_transformation(model, False, False, False, False)
    results = model.get_results()
    if len(results) != 1:
        raise ConfigError(f"{xml.name}: expected one output (logits), found {len(results)}")
    head = results[0].input_value(0).get_node()
    if head.get_type_name() != "MatMul":
        raise ConfigError(f"{xml.name}: the logits come from {head.get_type_name()}, not the head's MatMul")
    rows = ops.parameter(ov.PartialShape([-1]), ov.Type.i64, name="logits_indices")
    rows.output(0).get_tensor().set_names({"logits_indices"})
    head.input(0).replace_source_output(ops.gather(head.input_value(0), rows, ops.constant(np.int64(0))).output(0))
    model.add_parameters([rows])
    model.validate_nodes_and_infer_types()
    return model


def _weight_products(model):
    """(MatMul, its [out, in] FP32 weight, transpose_b, is the head) for each product whose weight is a
    converted constant: the layers' projections and the output head."""
    head = model.get_results()[0].input_value(0).get_node()
    for node in model.get_ordered_ops():
        if node.get_type_name() != "MatMul":
            continue
        convert = node.input_value(1).get_node()
        if convert.get_type_name() != "Convert" or convert.input_value(0).get_node().get_type_name() != "Constant":
            continue
        weight = convert.input_value(0).get_node().get_data().astype(np.float32)
        transpose_b = bool(node.get_attributes().get("transpose_b", False))
        yield node, weight if transpose_b else weight.T, transpose_b, node is head


def int4_codes(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [out, blocks, 32] uint8, scale and zero point [out, blocks, 1] float16): Q4_1 blocks
    (:func:`~python_backends.generation.linear.int4_blocks`, ``w = q * scale + minimum``) in OpenVINO's
    decompression form ``w = (q - zero point) * scale``. A block of equal weights (scale 0) gets
    scale ``minimum / 8`` and zero point -8."""
    from python_backends.generation.linear import int4_blocks

    q, scale, minimum = int4_blocks(torch.from_numpy(np.ascontiguousarray(weight)))  # refuses a partial block
    shape = (*scale.shape, 1)
    codes = q.numpy().astype(np.uint8).reshape(*scale.shape, -1)
    scale_np, minimum_np = scale.numpy().reshape(shape), minimum.numpy().reshape(shape)
    flat = scale_np == 0
    scale16 = np.where(flat, minimum_np / 8, scale_np).astype(np.float16)
    wide = np.where(scale16 == 0, 1, scale16).astype(np.float32)
    zero_point = np.where(flat, -8, -minimum_np / wide).astype(np.float16)
    return codes, scale16, zero_point


def int4_values(codes: np.ndarray, scale: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
    """The weights OpenVINO decodes from :func:`int4_codes`' parts, FP32 ``[out, in]``."""
    values = (codes.astype(np.float32) - zero_point.astype(np.float32)) * scale.astype(np.float32)
    return values.reshape(codes.shape[0], -1)


def int8_codes(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes [out, blocks, 32] int8, scale [out, blocks, 1] float16): symmetric 8-bit blocks."""
    blocks = weight.reshape(weight.shape[0], -1, OV_HEAD_GROUP)
    scale = (np.abs(blocks).max(-1, keepdims=True) / 127).astype(np.float16)
    wide = scale.astype(np.float32)
    codes = np.round(blocks / np.where(wide == 0, 1, wide)).clip(-127, 127).astype(np.int8)
    return codes, scale


def quantize_int4(model) -> int:
    """``ov_int4_f16``'s 4-bit graph: each layer's product in ``model`` reads 4-bit codes (the head 8-bit
    ones) through OpenVINO's decompression pattern (codes -> F16, minus the zero point, times the scale),
    which the CPU plugin runs inside its matrix kernel. Returns the number of products rounded."""
    import openvino as ov
    import openvino.opset13 as ops

    def layout(value, out_features: int, in_features: int, transpose_b: bool):
        value = ops.reshape(value, ops.constant(np.array([out_features, in_features], np.int64)), False)
        return value if transpose_b else ops.transpose(value, ops.constant(np.array([1, 0], np.int64)))

    n = 0
    for node, weight, transpose_b, is_head in _weight_products(model):  # one FP32 weight at a time
        out_features, in_features = weight.shape
        if is_head:
            codes, scale = int8_codes(weight)
            decoded = ops.multiply(ops.convert(ops.constant(codes), ov.Type.f16), ops.constant(scale))
        else:
            codes4, scale, zero_point = int4_codes(weight)
            packed = codes4.reshape(-1)
            u4 = ov.Tensor(ov.Type.u4, ov.Shape(list(codes4.shape)))
            np.copyto(u4.data.reshape(-1), (packed[0::2] | (packed[1::2] << 4)).astype(np.uint8))
            decoded = ops.multiply(
                ops.subtract(ops.convert(ops.constant(u4), ov.Type.f16), ops.constant(zero_point)), ops.constant(scale)
            )
        node.input(1).replace_source_output(
            ops.convert(layout(decoded, out_features, in_features, transpose_b), ov.Type.f32).output(0)
        )
        n += 1
    model.validate_nodes_and_infer_types()
    return n


class OpenVINORunner:
    """An OpenVINO paged-attention model behind :class:`~python_backends.generation.model_runner.ModelRunner`'s interface."""

    def __init__(self, weights: OVWeights, num_blocks: int, block_size: int, max_model_len: int, num_threads: int | None = None):
        import openvino as ov

        self._ov = ov
        self.weights = weights
        self.config = weights.config
        self.vocab = int(weights.config.vocab_size)
        self.max_model_len = max_model_len
        self.num_threads = int(num_threads or os.cpu_count() or 1)
        self._caches: list[np.ndarray] = []  # every layer's K and V, shared with the request
        self.cache_type = ""
        self.node_profiling = False
        self.compiled_small: Any = None  # ov_int4_f16's 4-bit graph
        self._compile(num_blocks, block_size, {})  # the ov.Model is dropped once compiled: it holds a copy of the weights
        if len(self._caches) != 2 * self.config.num_layers:
            raise ConfigError(f"{weights.path.name}: {len(self._caches)} cache inputs for {self.config.num_layers} layers")
        self.block_size = block_size
        self.num_blocks = num_blocks
        log.info(
            "OpenVINO runner: %s (%.0f MiB), %d KV blocks of %d (%s, %.0f MiB), %d threads",
            weights.path.parent.name,
            weights.nbytes() / 2**20,
            num_blocks,
            block_size,
            self.cache_type,
            self.kv_nbytes() / 2**20,
            self.num_threads,
        )

    def _compile(self, num_blocks: int, block_size: int, extra: dict[str, object]) -> None:
        """Compile the paged model (ov_int4_f16: both its graphs) and bind the K/V cache arrays (made on
        the first call) to each request."""
        ov = self._ov
        properties = {"INFERENCE_NUM_THREADS": self.num_threads, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, **extra}
        core = ov.Core()
        self.compiled = core.compile_model(paged_model(self.weights.path), "CPU", properties)
        self._request = self.compiled.create_infer_request()
        self._small = None
        if self.weights.int4_path is not None:
            # The 4-bit products decode each weight block in F16 (no 8-bit activations): the gate's numbers.
            properties["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
            self.compiled_small = core.compile_model(paged_model(self.weights.int4_path), "CPU", properties)
            self._small = self.compiled_small.create_infer_request()
        self._last = self._request
        # ov_int4_f16 decodes on other weights (4-bit) than it prefills (F16): a continued stream's
        # tokens get their K/V one per step, as the decodes that made them did (Scheduler.replay_rows).
        self.replay_rows = 1 if self._small is not None else 0
        fresh = not self._caches
        cache_ports = [p for p in self.compiled.inputs if p.get_any_name().startswith(("key_cache.", "value_cache."))]
        for i, port in enumerate(cache_ports):
            dims = [d.get_length() for d in list(port.get_partial_shape())[1:]]
            element = port.get_element_type()
            if element.size != 2 or dims[1] != block_size:
                raise ConfigError(
                    f"{self.weights.precision}: OpenVINO's CPU plugin keeps K/V as {element.get_type_name()} in blocks of "
                    f"{dims[1]} tokens; block_size must be {dims[1]} (it is {block_size})"
                )
            if fresh:
                self._caches.append(np.zeros([num_blocks, *dims], np.uint16))
            array = self._caches[i]
            for request in (self._request, self._small):
                if request is not None:  # both graphs read and write the same cache
                    request.set_tensor(port.get_any_name(), ov.Tensor(array, array.shape, element))
            self.cache_type = element.get_type_name()

    def enable_node_profiling(self) -> None:
        """Recompile with OpenVINO's per-node counters on (the cache is kept): :meth:`node_times` then
        reads the last inference's time per node type. For the profiler only; the counters cost time."""
        if not self.node_profiling:
            self._compile(self.num_blocks, self.block_size, {"PERF_COUNT": True})
            self.node_profiling = True

    def node_times(self) -> dict[str, tuple[float, int]]:
        """(seconds, nodes) per executed node type ("FullyConnected", "PagedAttentionExtension", ...) in the last inference."""
        out: dict[str, tuple[float, int]] = {}
        for info in self._last.profiling_info:
            if info.status == info.Status.EXECUTED:
                s, n = out.get(info.node_type, (0.0, 0))
                out[info.node_type] = (s + info.real_time.total_seconds(), n + 1)
        return out

    def kv_nbytes(self) -> int:
        return sum(a.nbytes for a in self._caches)

    def close(self) -> None:
        self._request = self._small = self._last = None
        self.compiled = self.compiled_small = None
        self._caches = []

    def copy_blocks(self, copies) -> None:
        """Copies on write: the first ``n`` slots of block ``src`` into block ``dst``, every layer."""
        for src, dst, n in copies:
            for array in self._caches:
                array[dst, :, :n] = array[src, :, :n]

    def _infer(self, parts: list[tuple[list[int], int, list[int]]], rows: np.ndarray) -> torch.Tensor:
        """One inference over ``parts`` (tokens, first position, block table); logits of ``rows``."""
        ov, bs = self._ov, self.block_size
        tokens = np.fromiter((t for p in parts for t in p[0]), np.int64)
        positions = np.concatenate([np.arange(start, start + len(toks), dtype=np.int64) for toks, start, _ in parts])
        ends = [start + len(toks) for toks, start, _ in parts]
        tables = [table[: -(-end // bs)] for (_, _, table), end in zip(parts, ends)]
        feed = {
            "input_ids": tokens,
            "position_ids": positions,
            "past_lens": np.array([start for _, start, _ in parts], np.int32),
            "subsequence_begins": np.cumsum([0] + [len(p[0]) for p in parts], dtype=np.int32),
            "block_indices": np.fromiter((b for t in tables for b in t), np.int32),
            "block_indices_begins": np.cumsum([0] + [len(t) for t in tables], dtype=np.int32),
            "max_context_len": np.array(max(ends), np.int32),
            "logits_indices": rows,
        }
        request = self._small if self._small is not None and len(tokens) <= OV_INT4_MAX_ROWS else self._request
        self._last = request
        for name, value in feed.items():
            request.set_tensor(name, ov.Tensor(value))
        request.infer()
        logits = request.get_output_tensor(0).data
        return torch.from_numpy(logits.reshape(len(rows), self.vocab))

    def execute(self, plan) -> torch.Tensor:
        """Run every chunk of ``plan`` in one inference; FP32 logits ``[rows, vocab]`` in
        :meth:`ModelRunner.execute`'s order (valid until the next step)."""
        if plan.copies:
            self.copy_blocks(plan.copies)
        chunks = plan.chunks
        if not chunks:
            return torch.empty(0, self.vocab)
        rows: list[int] = []
        n = 0
        for c in chunks:
            if c.end > self.max_model_len:
                raise ValueError(f"position {c.end - 1} is beyond max_model_len {self.max_model_len}")
            n += c.end - c.start
            rows.extend(range(n - c.num_logits, n))
        parts = [(list(c.token_ids), c.start, list(c.block_table)) for c in chunks]
        # Prompt chunks that sample nothing still write their K/V (the head then computes one row).
        logits = self._infer(parts, np.array(rows or [0], np.int64))
        return logits if rows else torch.empty(0, self.vocab)

    def sequence_logits(self, token_ids: list[int], chunk: int = 256) -> torch.Tensor:
        """Teacher-forced FP32 logits of every position of ``token_ids`` (the gate), in chunks of
        ``chunk`` tokens written to the pool's first blocks; ``[len, vocab]``."""
        n = len(token_ids)
        table = list(range(-(-n // self.block_size)))
        if not 0 < n <= self.max_model_len or len(table) > self.num_blocks:
            raise ValueError(f"{n} tokens: the runner holds 1..{min(self.max_model_len, self.num_blocks * self.block_size)}")
        out = []
        for start in range(0, n, chunk):
            part = token_ids[start : start + chunk]
            out.append(self._infer([(part, start, table)], np.arange(len(part), dtype=np.int64)).clone())
        return torch.cat(out)
