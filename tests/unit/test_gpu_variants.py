"""GPU variants, run for real where a GPU, onnxruntime-gpu and TensorRT are present, and the
TensorRT version check of trt_plan variants, which runs everywhere (fake variants.json).

On CPU machines the GPU builds are skipped with the reason printed; the same pipeline code runs
on the CPU through the fp32/int8/fp16 variants (test_pipeline.py, test_text_quant.py). The
builds run on a copy of the model repository in a temporary folder: tests never write into the
source tree.
"""

import json
import shutil

import pytest

from export import pipeline, tensorrt_engine, variants
from export.text_encoder import TextEncoderPipeline
from server.layout import ROOT

SOURCE_REPO = ROOT / "model_repository"
gpu = pytest.mark.gpu


@pytest.fixture
def repo(tmp_path):
    """A copy of text_encoder's folder (exported files included) to build variants into."""
    copy = tmp_path / "model_repository"
    shutil.copytree(
        SOURCE_REPO / "text_encoder", copy / "text_encoder", ignore=shutil.ignore_patterns("__pycache__", "*.candidate")
    )
    return copy


def _ort_trt_reason() -> str | None:
    return TextEncoderPipeline().skip_reason("ort_trt_fp16")


@gpu
@pytest.mark.skipif(
    tensorrt_engine.unavailable_reason() is not None, reason=f"TensorRT engine: {tensorrt_engine.unavailable_reason()}"
)
def test_text_encoder_tensorrt_engine_builds_and_passes_its_gate(repo):
    report = pipeline.run(TextEncoderPipeline(), repo, speed=False, only=("trt_plan",))
    row = next(r for r in report["variants"] if r["variant"] == "trt_plan")
    assert row["status"] == "passed", row["reason"]
    assert row["metrics"]["cosine"] >= variants.load_gates()["text_encoder"]["trt_plan"]["min_cosine"]
    assert (repo / "text_encoder" / "configs" / "trt_plan.pbtxt").is_file()
    recorded = variants.read_manifest(repo, "text_encoder")["variants"]["trt_plan"]["tensorrt_version"]
    assert variants.same_tensorrt(recorded), recorded


@gpu
@pytest.mark.skipif(_ort_trt_reason() is not None, reason=f"ONNX Runtime TensorRT FP16: {_ort_trt_reason()}")
def test_text_encoder_onnxruntime_tensorrt_fp16_passes_its_gate(repo):
    report = pipeline.run(TextEncoderPipeline(), repo, speed=False, only=("ort_trt_fp16",))
    row = next(r for r in report["variants"] if r["variant"] == "ort_trt_fp16")
    assert row["status"] == "passed", row["reason"]


@gpu
def test_skip_reasons_name_what_is_missing():
    """Wherever they are skipped, the reasons must say why (printed by the export)."""
    reason = tensorrt_engine.unavailable_reason()
    if reason is not None:
        assert any(word in reason for word in ("GPU", "tensorrt", "PyTorch", "CUDA"))
    ort_reason = _ort_trt_reason()
    if ort_reason is not None:
        assert "GPU" in ort_reason or "TensorRT" in ort_reason


def _plan_repo(tmp_path, built_by):
    """A repository whose text_encoder serves a trt_plan built by TensorRT ``built_by``."""
    model = tmp_path / "text_encoder"
    (model / "1").mkdir(parents=True)
    (model / "configs").mkdir()
    (model / "config.pbtxt").write_text((SOURCE_REPO / "text_encoder" / "config.pbtxt").read_text())
    (model / "1" / "model.plan").write_bytes(b"engine")
    for name in ("gpu", "trt_plan", "fp16"):
        (model / "configs" / f"{name}.pbtxt").write_text("# variant config\n")
    entry = {"status": "passed", "file": "model.plan", "file_sha256": "x"}
    if built_by is not None:
        entry["tensorrt_version"] = built_by
    manifest = {
        "model": "text_encoder",
        "best": {"gpu": "trt_plan", "cpu": "int8"},
        "variants": {"trt_plan": entry, "fp16": {"status": "passed", "file": "model.fp16.onnx"}},
    }
    (model / "variants.json").write_text(json.dumps(manifest))
    return tmp_path


@pytest.mark.parametrize("precision", ["gpu", "trt_plan"])
def test_a_plan_built_by_another_tensorrt_is_refused_naming_both_versions(tmp_path, precision):
    repo = _plan_repo(tmp_path, "11.4.0.106")
    with pytest.raises(ValueError) as refused:
        variants.resolve_precision(repo, ["text_encoder"], precision, gpu=True)
    message = str(refused.value)
    assert "built by TensorRT 11.4.0.106" in message and f"serving TensorRT is {variants.SERVING_TENSORRT}" in message


def test_a_plan_without_a_recorded_tensorrt_is_refused(tmp_path):
    repo = _plan_repo(tmp_path, None)
    with pytest.raises(ValueError, match="records no TensorRT version"):
        variants.resolve_precision(repo, ["text_encoder"], "gpu", gpu=True)


def test_a_plan_built_by_the_serving_tensorrt_is_served(tmp_path):
    repo = _plan_repo(tmp_path, variants.SERVING_TENSORRT + ".18")  # the container's 10.5.0.18
    assert variants.resolve_precision(repo, ["text_encoder"], "gpu", gpu=True) == ("gpu", {"text_encoder": "trt_plan"})


def test_the_manifest_records_the_tensorrt_that_built_the_plan(tmp_path, monkeypatch):
    from python_backends.files import sha256_file

    repo = _plan_repo(tmp_path, None)
    plan = repo / "text_encoder" / "1" / "model.plan"
    for installed, served in ((variants.SERVING_TENSORRT, True), ("11.4.0.106", False)):
        monkeypatch.setattr(variants, "installed_tensorrt", lambda installed=installed: installed)
        plan.write_bytes(f"engine built by {installed}".encode())  # a new build: a new file
        entry = {"status": "passed", "file": "model.plan", "file_sha256": sha256_file(plan)}
        variants.write_manifest(repo, "text_encoder", {"model": "text_encoder", "variants": {"trt_plan": entry}})
        recorded = variants.read_manifest(repo, "text_encoder")["variants"]["trt_plan"]
        assert recorded["tensorrt_version"] == installed
        assert ("not_served" not in recorded) == served, recorded
        # The record describes this file: a later export run reuses it, whatever TensorRT is installed.
        monkeypatch.setattr(variants, "installed_tensorrt", lambda: None)
        assert variants.plan_tensorrt(repo / "text_encoder") == installed


def test_the_best_gpu_config_passes_over_a_plan_of_another_tensorrt(tmp_path, monkeypatch):
    repo = _plan_repo(tmp_path, None)
    monkeypatch.setattr(variants, "installed_tensorrt", lambda: "11.4.0.106")
    best = variants.write_best_configs(repo / "text_encoder", ["fp32", "fp16", "trt_plan"])
    assert best["gpu"] == "fp16"
    assert not (repo / "text_encoder" / "configs" / "trt_plan.pbtxt").exists()
    assert 'default_model_filename: "model.fp16.onnx"' in (repo / "text_encoder" / "configs" / "gpu.pbtxt").read_text()
    monkeypatch.setattr(variants, "installed_tensorrt", lambda: variants.SERVING_TENSORRT)
    assert variants.write_best_configs(repo / "text_encoder", ["fp32", "fp16", "trt_plan"])["gpu"] == "trt_plan"


def test_the_engine_builder_refuses_another_tensorrt(monkeypatch):
    monkeypatch.setattr(variants, "installed_tensorrt", lambda: "11.4.0.106")
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    reason = tensorrt_engine.unavailable_reason()
    assert reason is not None and "tensorrt 11.4.0.106 is installed" in reason and variants.SERVING_TENSORRT in reason
