"""The engine's matrix products per weight precision (python_backends/generation/linear.py)."""

from __future__ import annotations

import pytest
import torch

from contract.errors import ConfigError
from python_backends.generation import linear
from python_backends.generation.linear import Bf16Linear, Fp16Linear, Int4Bf16Linear, Linear, int4_blocks, make_linear

NEEDS_BF16 = pytest.mark.skipif(
    not linear.has_fast_bf16(), reason="this CPU has no AVX512-BF16 or AMX: bf16 and int4_bf16 are not offered here"
)
NEEDS_FBGEMM = pytest.mark.skipif(
    not linear.has_fbgemm(), reason=f"no fbgemm here ({linear.describe_cpu()}): fp16_fp32 is not offered"
)


def q4_1_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A weight made of Q4_1 blocks, as the GGUF's dequantized tensors are: q * d + m per 32 inputs,
    d and m FP16 values, every block using code 0 and code 15."""
    g = torch.Generator().manual_seed(seed)
    blocks = in_features // 32
    q = torch.randint(0, 16, (out_features, blocks, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_features, blocks, 1, generator=g) * 0.01 + 1e-4).half().float()
    m = (-torch.rand(out_features, blocks, 1, generator=g) * 0.08).half().float()
    return (q.float() * d + m).reshape(out_features, in_features)


def test_int4_blocks_recover_q4_1_weights_exactly():
    w = q4_1_weight(64, 128)
    q, scale, minimum = int4_blocks(w)
    assert q.dtype == torch.int32 and int(q.min()) == 0 and int(q.max()) == 15
    back = (q.reshape(64, 4, 32).float() * scale[..., None] + minimum[..., None]).reshape(64, 128)
    assert torch.equal(back, w)


def test_int4_blocks_round_other_weights_and_refuse_odd_widths():
    w = torch.randn(8, 64)
    q, scale, minimum = int4_blocks(w)
    back = (q.reshape(8, 2, 32).float() * scale[..., None] + minimum[..., None]).reshape(8, 64)
    assert float((back - w).abs().max()) <= float(scale.max()) / 2 + 1e-6  # half a step at most
    assert not torch.equal(back, w)
    with pytest.raises(ConfigError, match="blocks of 32"):
        int4_blocks(torch.randn(4, 48))
    flat = torch.ones(2, 32)  # a constant block: scale 0, no division by it
    q, scale, minimum = int4_blocks(flat)
    assert torch.equal(q, torch.zeros_like(q)) and torch.equal(minimum, torch.ones(2, 1))


@NEEDS_BF16
@pytest.mark.parametrize("rows", [1, linear.INT4_MAX_ROWS, linear.INT4_MAX_ROWS + 1, 40])
def test_int4_bf16_both_paths_multiply_by_the_same_blocks(rows):
    w = q4_1_weight(96, 128, seed=rows)
    layer = make_linear(w, "int4_bf16")
    assert isinstance(layer, Int4Bf16Linear) and layer.precision == "int4_bf16"
    # the kernel's weight: the exact codes with BF16 scales and zeros, within BF16 rounding of w
    assert torch.allclose(layer.dequantized(), w, rtol=0, atol=float(w.abs().max()) * 2**-7)
    x = torch.randn(rows, 128)
    exact = x @ w.t()
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    # BF16 activations: about 3 significant digits of each product's terms
    assert torch.allclose(got, exact, rtol=0.02, atol=0.02 * float(exact.abs().max()))


@NEEDS_BF16
def test_bf16_linear_keeps_fp32_in_and_out():
    w = torch.randn(32, 64) * 0.05
    layer = make_linear(w, "bf16")
    assert isinstance(layer, Bf16Linear) and layer.weight.dtype == torch.bfloat16
    x = torch.randn(5, 64)
    out = layer(x)
    assert out.dtype == torch.float32
    assert torch.allclose(out, x @ w.t(), rtol=0.02, atol=0.02)
    assert layer.nbytes == 32 * 64 * 2


@NEEDS_FBGEMM
@pytest.mark.parametrize("rows", [0, 1, 7, 33, 300])
def test_fp16_fp32_linear_is_fp32_products_of_the_fp16_rounded_weight(rows):
    w = torch.randn(96, 128) * 0.05
    layer = make_linear(w, "fp16_fp32")
    assert isinstance(layer, Fp16Linear) and layer.precision == "fp16_fp32" and layer.nbytes == 96 * 128 * 2
    assert torch.equal(layer.weight, w.half().float())  # what the kernel multiplies by
    x = torch.randn(rows, 128)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    assert torch.allclose(got, x @ w.half().float().t(), rtol=1e-5, atol=1e-5)
    assert not torch.equal(w.half().float(), w)  # and that is not the FP32 weight
    strided = torch.randn(rows, 256)[:, ::2]  # a non-contiguous view is multiplied as its values
    assert torch.allclose(layer(strided), strided @ w.half().float().t(), rtol=1e-5, atol=1e-5)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16  # activations in another dtype come back in it


def test_fp32_linear_is_f_linear_bit_for_bit():
    w, x = torch.randn(16, 32), torch.randn(3, 32)
    layer = make_linear(w, "fp32")
    assert type(layer) is Linear and torch.equal(layer(x), torch.nn.functional.linear(x, w))


def test_unknown_precision_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match=r"weights_precision 'int3'.*fp32, fp16_fp32, bf16, int4_bf16"):
        make_linear(torch.randn(4, 32), "int3")


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 sha_ni
"""


def test_cpu_features_pick_the_precisions_and_the_fingerprint():
    with_bf16 = linear.cpu_features.__wrapped__(CPUINFO)
    assert with_bf16 == {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}
    avx2_only = linear.cpu_features.__wrapped__(CPUINFO.replace(" avx512f avx512_vnni avx512_bf16", ""))
    assert avx2_only == {"avx2"}
    fbgemm = "fbgemm" in torch.backends.quantized.supported_engines  # this torch's build
    fp16 = ("fp16_fp32",) if fbgemm else ()
    assert linear.runnable_precisions("cpu", with_bf16) == ("fp32", *fp16, "bf16", "int4_bf16")
    assert linear.runnable_precisions("cpu", avx2_only) == ("fp32", *fp16)  # BF16 emulated there: slower than FP32
    assert linear.runnable_precisions("cpu", frozenset()) == ("fp32",)  # fbgemm needs AVX2
    assert linear.runnable_precisions("cuda:0", with_bf16) == ("fp32",)
    assert linear.kernel_fingerprint(with_bf16) != linear.kernel_fingerprint(avx2_only)
    assert linear.kernel_fingerprint(with_bf16) == linear.kernel_fingerprint(frozenset(with_bf16))


@NEEDS_BF16
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
def test_bf16_products_through_the_packed_weight_equal_f_linear_bit_for_bit(rows):
    w = (torch.randn(96, 128) * 0.05).to(torch.bfloat16)
    product = linear.PackedBf16(w)
    assert product.packed is not None, "oneDNN's packed BF16 product is expected on a CPU with AVX512-BF16"
    x = torch.randn(rows, 128).to(torch.bfloat16)
    assert torch.equal(product(x), torch.nn.functional.linear(x, w))
    assert torch.equal(product.unpacked(), w)  # the weight read back from the packed layout, exactly


def test_kv_cache_dtype_follows_the_weights_precision_on_a_cpu_only():
    assert linear.kv_cache_dtype("fp32", torch.float32) == torch.float32  # exact parity with transformers
    assert linear.kv_cache_dtype("bf16", torch.float32) == torch.bfloat16
    assert linear.kv_cache_dtype("int4_bf16", torch.float32) == torch.bfloat16
    assert linear.kv_cache_dtype("fp16_fp32", torch.float32) == torch.float32  # FP32 products, FP32 K/V
    assert linear.kv_cache_dtype("fp32", torch.bfloat16, "cuda:0") == torch.bfloat16
