"""GPU variants, run for real where a GPU, onnxruntime-gpu and TensorRT are present.

On CPU machines these are skipped with the reason printed; the same pipeline code runs on
the CPU through the fp32/int8/fp16 variants (test_pipeline.py, test_text_quant.py).
"""

import pytest

from export import pipeline, tensorrt_engine, variants
from export.text_encoder import TextEncoderPipeline
from server.layout import ROOT

pytestmark = pytest.mark.gpu

REPO = ROOT / "model_repository"


def _ort_trt_reason() -> str | None:
    return TextEncoderPipeline().skip_reason("ort_trt_fp16")


@pytest.mark.skipif(tensorrt_engine.unavailable_reason() is not None,
                    reason=f"TensorRT engine: {tensorrt_engine.unavailable_reason()}")
def test_text_encoder_tensorrt_engine_builds_and_passes_its_gate(tmp_path):
    report = pipeline.run(TextEncoderPipeline(), REPO, speed=False, only=("trt_plan",))
    row = next(r for r in report["variants"] if r["variant"] == "trt_plan")
    assert row["status"] == "passed", row["reason"]
    assert row["metrics"]["cosine"] >= variants.load_gates()["text_encoder"]["trt_plan"]["min_cosine"]
    assert (REPO / "text_encoder" / "configs" / "trt_plan.pbtxt").is_file()


@pytest.mark.skipif(_ort_trt_reason() is not None, reason=f"ONNX Runtime TensorRT FP16: {_ort_trt_reason()}")
def test_text_encoder_onnxruntime_tensorrt_fp16_passes_its_gate():
    report = pipeline.run(TextEncoderPipeline(), REPO, speed=False, only=("ort_trt_fp16",))
    row = next(r for r in report["variants"] if r["variant"] == "ort_trt_fp16")
    assert row["status"] == "passed", row["reason"]


def test_skip_reasons_name_what_is_missing():
    """Wherever they are skipped, the reasons must say why (printed by the export)."""
    reason = tensorrt_engine.unavailable_reason()
    if reason is not None:
        assert any(word in reason for word in ("GPU", "tensorrt", "PyTorch", "CUDA"))
    ort_reason = _ort_trt_reason()
    if ort_reason is not None:
        assert "GPU" in ort_reason or "TensorRT" in ort_reason
