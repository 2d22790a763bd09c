"""The engine's matrix products, per weight precision: FP32, FP16, BF16, and INT4 blocks with BF16.

Every projection of the model (Q/K/V, O, gate/up, down and the output head) is one
:class:`Linear`: activations in the engine's dtype in and out, whatever the weights are held in.
The residual stream, the norms and RoPE stay in the engine's dtype; the BF16 variants also hold
the KV cache in BF16 (:data:`KV_DTYPE`). Which precisions a CPU runs well is decided here, from what the
CPU has (:func:`cpu_features`), through PyTorch's own kernels, never loops written in Python:

* ``fp32``: ``F.linear`` on FP32 weights (oneDNN / MKL sgemm). The reference; exact parity
  with ``transformers``.
* ``fp16_fp32``: FP16 weights packed once for fbgemm's FP16 GEMM (``quantized.linear_dynamic_fp16``):
  the weights are read as half the bytes and widened to FP32 in registers, activations and
  products stay FP32, as does the KV cache. The numbers are FP32 products with FP16-rounded
  weights. Offered wherever fbgemm runs (AVX2): on a 2-core AVX2 EPYC, SmolLM2's 120 layer
  products take 12 ms at 1 row against FP32's 36, 29 against 66 at 16 rows, 52 against 92 at 32.
* ``bf16``: BF16 weights prepacked once in oneDNN's layout (:class:`PackedBf16`), activations
  cast to BF16 for the product (oneDNN's AVX512-BF16 or AMX kernels), output back to FP32. Offered only where the CPU has AVX512-BF16 or AMX:
  elsewhere PyTorch emulates BF16 and it is slower than FP32.
* ``int4_bf16``: the weights as 4-bit blocks of 32 along the input axis with a scale and a
  minimum per block (GGUF's Q4_1 layout, which is what the packaged SmolLM2 ships: those
  blocks are recovered exactly, only their scales rounded to BF16), multiplied by
  ``aten._weight_int4pack_mm_for_cpu`` with BF16 activations when a call has at most
  ``INT4_MAX_ROWS`` rows (a decode step of a few streams: it waits for weight bytes, and
  these are an eighth of FP32's), and by the prepacked BF16 copy of the same weights above that
  (more streams or a prompt chunk: there the 4-bit kernel is slower than oneDNN's BF16 GEMM).

Tried and not offered: INT8 through fbgemm's dynamic quantized linear (one activation scale
per call) moved the next-token distribution 1,000 times further than BF16 (mean KL 0.81
nats on the held-out text): SmolLM2's MLP activations have outlier channels that a single
scale flattens (docs/generation-internals.md has the figures). onnxruntime's MatMulNBits (4- or 8-bit blocks,
activations quantized per block to INT8) was no faster than fbgemm's FP16 product on the 2-core AVX2
EPYC (the four layer products at 1 row: 6.6-12.2 ms against 8.5-9.3 per step, slower from 4 rows), and
re-quantizing the Q4_1 weights to its integer zero points moved the distribution far (mean KL 0.40).

Which precision a model is served in is a gated choice made at export time
(``export/generation_gate.py``); this module only builds what it is asked for.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F

from contract.errors import ConfigError

PRECISIONS = ("fp32", "fp16_fp32", "bf16", "int4_bf16")
# Rows up to which int4_bf16 runs the packed 4-bit kernel; above, oneDNN's prepacked BF16 GEMM is
# faster (SmolLM2's 120 products on an AVX-512 EPYC, 2 threads, 4-bit vs BF16: 24 vs 27 ms at 12 rows,
# 29 vs 26 at 16, 38 vs 30 at 24; docs/generation-internals.md).
INT4_MAX_ROWS = 12
INT4_GROUP = 32
# The output head's precision per variant. int4_bf16 keeps the head in BF16: the packaged model's
# head (its tied token embedding) is Q8_0 in the GGUF, and 4-bit blocks would round it (mean KL
# 0.05 nats on the held-out text with a 4-bit head, 0.001 with BF16).
HEAD_PRECISION = {"fp32": "fp32", "fp16_fp32": "fp16_fp32", "bf16": "bf16", "int4_bf16": "bf16"}
# The profiler's names of the ops these products run (F.linear: mm/addmm), for step profiles.
PRODUCT_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::_weight_int4pack_mm_for_cpu",
    "mkldnn::_linear_pointwise",
    "quantized::linear_dynamic_fp16",
)
# Kernel code paths that change numbers: a variant gated under one of these is gated again under another.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=1)
def cpu_features(cpuinfo: str | None = None) -> frozenset[str]:
    """The KERNEL_FLAGS this CPU has (from /proc/cpuinfo; empty where it cannot be read)."""
    text = cpuinfo
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return frozenset(f for f in KERNEL_FLAGS if f in flags)


def has_vnni(features: frozenset[str] | None = None) -> bool:
    features = cpu_features() if features is None else features
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & features)


def has_fast_bf16(features: frozenset[str] | None = None) -> bool:
    features = cpu_features() if features is None else features
    return bool({"avx512_bf16", "amx_bf16"} & features)


def has_fbgemm(features: frozenset[str] | None = None) -> bool:
    """Whether fbgemm's kernels (fp16_fp32) run here: this torch has them and the CPU has AVX2."""
    features = cpu_features() if features is None else features
    return "avx2" in features and "fbgemm" in torch.backends.quantized.supported_engines


# The KV cache's dtype per weights precision on a CPU. The BF16 variants keep K and V in BF16: half
# the bytes that every decode step's attention reads, and twice the tokens a kv_cache_mb holds; the
# gate measures it, since its teacher-forced passes read K/V back from the pool. fp32 keeps the
# engine's dtype (exact parity with transformers).
KV_DTYPE = {"bf16": torch.bfloat16, "int4_bf16": torch.bfloat16}


def kv_cache_dtype(precision: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype the KV pool holds for weights in ``precision`` and activations in ``dtype``."""
    if torch.device(device).type != "cpu":
        return dtype
    return KV_DTYPE.get(precision, dtype)


def kernel_fingerprint(features: frozenset[str] | None = None) -> str:
    """Identifies the kernels a variant ran on: torch's version, the rows where int4_bf16 switches
    kernels, the precisions offered here, and the CPU flags that pick code paths. A gate recorded under another fingerprint is
    not trusted."""
    features = cpu_features() if features is None else features
    kv = ",".join(f"{p}:{str(d).removeprefix('torch.')}" for p, d in sorted(KV_DTYPE.items()))
    offered = ",".join(runnable_precisions("cpu", features))
    text = f"torch {torch.__version__}; int4 rows {INT4_MAX_ROWS}; kv {kv}; offered {offered}; {' '.join(sorted(features))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe_cpu(features: frozenset[str] | None = None) -> str:
    features = cpu_features() if features is None else features
    return f"torch {torch.__version__}, {' '.join(sorted(features)) or 'no AVX2'}"


def runnable_precisions(device: torch.device | str = "cpu", features: frozenset[str] | None = None) -> tuple[str, ...]:
    """The precisions worth running here: every one on a CPU that has the kernels for it."""
    if torch.device(device).type != "cpu":
        return ("fp32",)  # the GPU path computes in the engine's dtype (bfloat16 there)
    offered = ["fp32"]
    if has_fbgemm(features):
        offered.append("fp16_fp32")
    if has_fast_bf16(features):
        offered += ["bf16", "int4_bf16"]
    return tuple(offered)


class Linear:
    """``y = x @ W.T`` for activations ``x`` of shape ``[rows, in]``."""

    precision = "fp32"

    def __init__(self, weight: torch.Tensor):
        self._weight = weight
        self.out_features, self.in_features = weight.shape

    @property
    def weight(self) -> torch.Tensor:
        return self._weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._weight)

    @property
    def nbytes(self) -> int:
        return self._weight.numel() * self._weight.element_size()


class PackedBf16:
    """``x @ W.T`` for BF16 ``x`` and a BF16 weight, through oneDNN with the weight reordered once into
    its blocked layout (``torch.ops.mkldnn``): the numbers of ``F.linear`` bit for bit, 8-24 % faster at
    32-288 rows on an AVX-512 EPYC (``F.linear`` reorders the weight on every call). Where this torch
    lacks the ops, or their result differs from ``F.linear`` on a probe, the plain weight is used."""

    def __init__(self, weight: torch.Tensor):
        self.shape = weight.shape
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            same = torch.equal(self._packed_mm(probe, packed), F.linear(probe, weight))
        except (AttributeError, RuntimeError):
            return
        if same:
            self.packed, self.weight = packed, None

    @staticmethod
    def _packed_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            assert self.weight is not None  # one of packed and weight
            return F.linear(x, self.weight)
        return self._packed_mm(x, self.packed)

    def unpacked(self) -> torch.Tensor:
        """The weight itself, ``[out, in]`` BF16 (from the packed layout: exact, the identity times it)."""
        if self.packed is None:
            assert self.weight is not None  # one of packed and weight
            return self.weight
        return self._packed_mm(torch.eye(self.shape[1], dtype=torch.bfloat16), self.packed).t().contiguous()

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 2


class Fp16Linear(Linear):
    """FP32 activations times FP16 weights through fbgemm (``quantized.linear_dynamic_fp16``), the
    weight packed once. Its result is checked on a probe against ``F.linear`` with the FP16-rounded
    weight; a kernel that disagrees is refused (the variant fails its build, FP32 serves)."""

    precision = "fp16_fp32"

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float().contiguous()
        try:
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
        except RuntimeError as exc:
            raise ConfigError(f"weights_precision 'fp16_fp32': fbgemm cannot pack the weight here ({exc})") from exc
        probe = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0))
        want = F.linear(probe, weight.half().float())
        # FP32 accumulation in another order: about 1e-6 of the output's scale on SmolLM2's weights.
        if not torch.allclose(self(probe), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()) + 1e-6):
            raise ConfigError("weights_precision 'fp16_fp32': fbgemm's FP16 product differs from FP32 with FP16 weights")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the runner's activations: no cast to dispatch (120 calls a step)
            return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)
        return torch.ops.quantized.linear_dynamic_fp16(x.float().contiguous(), self.packed).to(x.dtype)

    @property
    def weight(self) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0]

    @property
    def nbytes(self) -> int:
        """The FP16 bytes a product reads; fbgemm's packed buffer holds about 1.8x that (docs/generation-internals.md)."""
        return self.out_features * self.in_features * 2


class Bf16Linear(Linear):
    precision = "bf16"

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.product = PackedBf16(weight.to(torch.bfloat16).contiguous())

    @property
    def weight(self) -> torch.Tensor:
        return self.product.unpacked()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x.to(torch.bfloat16)).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.product.nbytes


def int4_blocks(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, minimum)``: ``weight`` as 4-bit codes per block of ``group`` inputs, ``w = q * scale +
    minimum`` (Q4_1's layout: the block's minimum and (max - min) / 15). Weights that were Q4_1 blocks
    come back exactly; others are rounded to the nearest of 16 levels."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise ConfigError(f"a {in_features}-input projection does not split into blocks of {group}")
    w = weight.detach().float().reshape(out_features, in_features // group, group)
    minimum = w.amin(-1, keepdim=True)
    scale = (w.amax(-1, keepdim=True) - minimum) / 15
    q = torch.where(scale > 0, (w - minimum) / torch.where(scale > 0, scale, 1), 0).round().clamp(0, 15)
    return q.to(torch.int32).reshape(out_features, in_features), scale.squeeze(-1), minimum.squeeze(-1)


class Int4Bf16Linear(Linear):
    precision = "int4_bf16"

    def __init__(self, weight: torch.Tensor, max_rows: int = INT4_MAX_ROWS):
        q, scale, minimum = int4_blocks(weight)
        self.out_features, self.in_features = weight.shape
        self.max_rows = max_rows
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # The kernel's convention: w = (q - 8) * scale + zero, per [group, output] pair.
        self.scales_zeros = torch.stack([scale, minimum + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        # The same weights for calls above max_rows: (q - 8) * scale + zero with the kernel's BF16
        # scales and zeros, rounded to BF16.
        sz = self.scales_zeros.float().transpose(0, 1)[:, :, None, :]  # [out, groups, 1, 2]
        blocks = q.reshape(self.out_features, -1, INT4_GROUP).float()
        self.bf16 = PackedBf16(((blocks - 8) * sz[..., 0] + sz[..., 1]).reshape(weight.shape).to(torch.bfloat16).contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if x.shape[0] <= self.max_rows:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, INT4_GROUP, self.scales_zeros)
        else:
            y = self.bf16(xb)
        return y.to(x.dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.bf16.unpacked()

    def dequantized(self) -> torch.Tensor:
        """The weight both paths multiply by, in FP32 (the codes times the BF16 scales and zeros, in BF16)."""
        return self.weight.float()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2 + self.bf16.nbytes


def make_linear(weight: torch.Tensor, precision: str) -> Linear:
    """The Linear of ``weight`` in ``precision`` (one of PRECISIONS)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"weights_precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return Linear(weight)
    if weight.device.type != "cpu":
        raise ConfigError(
            f"weights_precision {precision!r} runs on CPU only; a GPU instance serves fp32 weights in the engine's dtype"
        )
    if precision == "fp16_fp32":
        return Fp16Linear(weight)
    if precision == "bf16":
        return Bf16Linear(weight)
    return Int4Bf16Linear(weight)
