"""``python -m export.llama_cpp formats``'s parts on the exported model: a head type that overrides the
quantizer's choice, and the claim its table rests on (docs/performance.md): the FP32 export holds the
packaged Q4_1 grid, so the Q4_1 file, requantized to F16, computes what the F16 file computes."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from python_backends.generation.llama_cpp_runtime import gguf_file

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "text_generation" / "1"


def _built() -> bool:
    from export.llama_cpp import is_built

    return is_built() and all((MODEL_DIR / gguf_file(p)).is_file() for p in ("llama_f16", "llama_q4_1"))


pytestmark = pytest.mark.skipif(not _built(), reason="llama.cpp not built or text_generation not exported (python -m export)")


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def test_head_type_overrides_the_quantizers_choice_and_q4_1_keeps_the_weights(tmp_path):
    from tokenizers import Tokenizer

    from export.llama_cpp import _kl_top1, _logits_and_decode, quantize
    from python_backends.generation.llama_cpp_runtime import load_library

    q4_1 = MODEL_DIR / gguf_file("llama_q4_1")
    assert _types(q4_1)["token_embd.weight"] == "Q8_0"  # the quantizer's head: 576 is no multiple of 256
    f16_head = quantize(q4_1, tmp_path / "q4_1-f16-head.gguf", "Q4_1", allow_requantize=True, head_type="F16")
    types = _types(f16_head)
    assert types["token_embd.weight"] == "F16" and types["blk.0.ffn_down.weight"] == "Q4_1"

    lib = load_library()
    ids = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode("The capital of France is Paris, and the").ids
    reference, _ = _logits_and_decode(lib, MODEL_DIR / gguf_file("llama_f16"), [ids], 2)
    dequantized = quantize(q4_1, tmp_path / "q4_1-as-f16.gguf", "F16", allow_requantize=True)
    kl, top1 = _kl_top1(reference, _logits_and_decode(lib, dequantized, [ids], 2)[0])
    assert kl < 1e-6 and top1 == 1.0
    as_computed, _ = _kl_top1(reference, _logits_and_decode(lib, q4_1, [ids], 2)[0])
    print(f"Q4_1 as llama.cpp computes it: mean KL {as_computed:.5f}")
    assert as_computed > 1e-4  # llama.cpp's 8-bit activations: the error is in the products, not the weights
