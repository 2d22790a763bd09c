"""Variant configs, gates and the PRECISION setting (export/variants.py)."""

import re

import pytest

from export import variants
from export.variants import VARIANTS

ROOT_CONFIG = (variants.GATES_FILE.parent.parent / "model_repository" / "text_encoder" / "config.pbtxt").read_text()


def test_gates_file_covers_every_variant_and_uses_min_max_keys():
    gates = variants.load_gates()
    for model, per_variant in gates.items():
        for name, gate in per_variant.items():
            known = variants.GENERATION_VARIANTS if model == "text_generation" else VARIANTS
            assert name in known, f"{model}.{name}: unknown variant"
            assert gate and all(k.startswith(("min_", "max_")) for k in gate)


def test_check_gate():
    gate = {"min_cosine": 0.99, "max_prob_diff": 0.05}
    assert variants.check_gate({"cosine": 0.995, "prob_diff": 0.01}, gate) == []
    assert variants.check_gate({"cosine": 0.98, "prob_diff": 0.01}, gate) == ["cosine = 0.98 < 0.99"]
    assert variants.check_gate({"cosine": float("nan"), "prob_diff": 0.2}, gate) == [
        "cosine = nan < 0.99",
        "prob_diff = 0.2 > 0.05",
    ]
    assert variants.check_gate({}, {"min_cosine": 0.9}) == ["cosine = None < 0.9"]
    with pytest.raises(ValueError, match="must start with min_ or max_"):
        variants.check_gate({}, {"cosine": 0.9})


def test_int8_config_points_at_its_file_and_keeps_everything_else():
    text = variants.variant_config(ROOT_CONFIG, VARIANTS["int8"])
    assert text.startswith("# GENERATED")
    assert re.search(r'^default_model_filename: "model.int8.onnx"$', text, re.M)
    assert 'backend: "onnxruntime"' in text and "dynamic_batching" in text and "preferred_batch_size" in text


def test_trt_plan_config_switches_platform_and_drops_onnxruntime_parameters():
    text = variants.variant_config(ROOT_CONFIG, VARIANTS["trt_plan"])
    assert 'platform: "tensorrt_plan"' in text and 'backend: "onnxruntime"' not in text
    assert "intra_op_thread_count" not in text and "allow_spinning" not in text
    assert 'default_model_filename: "model.plan"' in text
    assert "dynamic_batching" in text


def test_ort_trt_config_adds_the_tensorrt_accelerator():
    text = variants.variant_config(ROOT_CONFIG, VARIANTS["ort_trt_fp16"])
    assert 'name: "tensorrt"' in text and 'value: "FP16"' in text
    assert text.count("optimization {") == 1


def test_config_that_sets_the_filename_itself_is_refused():
    with pytest.raises(ValueError, match="must not set default_model_filename"):
        variants.variant_config(ROOT_CONFIG + '\ndefault_model_filename: "x.onnx"\n', VARIANTS["int8"])


def test_generated_configs_parse_with_tritons_text_format():
    """protobuf's text parser refuses duplicate singular fields, as Triton's does."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    for name in ("int8", "cpu_opt", "fp16", "ort_trt_fp16", "trt_plan"):
        config = text_format.Parse(variants.variant_config(ROOT_CONFIG, VARIANTS[name]), model_config_pb2.ModelConfig())
        assert config.name == "text_encoder"
        assert config.default_model_filename == VARIANTS[name].filename
    assert (
        text_format.Parse(variants.variant_config(ROOT_CONFIG, VARIANTS["trt_plan"]), model_config_pb2.ModelConfig()).platform
        == "tensorrt_plan"
    )


def _fake_repo(tmp_path, passed):
    model_dir = tmp_path / "text_encoder"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(ROOT_CONFIG)
    for name in passed:
        variants.write_variant_config(model_dir, VARIANTS[name])
    entries = {n: {"status": "passed"} for n in passed}
    if "trt_plan" in passed:  # a plan built by the serving TensorRT, as variants.json records it
        plan = model_dir / "1" / "model.plan"
        plan.write_bytes(b"engine")
        entries["trt_plan"] = {
            "status": "passed",
            "tensorrt_version": variants.SERVING_TENSORRT,
            "file_sha256": variants.sha256_file(plan),
        }
        variants.write_manifest(tmp_path, "text_encoder", {"model": "text_encoder", "variants": entries})
    best = variants.write_best_configs(model_dir, passed)
    variants.write_manifest(tmp_path, "text_encoder", {"model": "text_encoder", "best": best, "variants": entries})
    return model_dir


def test_best_configs_and_auto_precision(tmp_path):
    model_dir = _fake_repo(tmp_path, ["fp32", "cpu_opt", "int8", "fp16"])
    assert "model.int8.onnx" in (model_dir / "configs" / "cpu.pbtxt").read_text()
    assert "model.fp16.onnx" in (model_dir / "configs" / "gpu.pbtxt").read_text()
    assert variants.resolve_precision(tmp_path, ["text_encoder"], "auto", gpu=False) == ("cpu", {"text_encoder": "int8"})
    assert variants.resolve_precision(tmp_path, ["text_encoder"], "auto", gpu=True) == ("gpu", {"text_encoder": "fp16"})
    assert variants.resolve_precision(tmp_path, ["text_encoder"], "fp32") == ("fp32", {"text_encoder": "fp32"})
    # a variant this model lacks: Triton falls back to config.pbtxt, and we say so
    assert variants.resolve_precision(tmp_path, ["text_encoder"], "trt_plan") == ("trt_plan", {"text_encoder": "fp32"})
    with pytest.raises(ValueError, match="PRECISION must be"):
        variants.resolve_precision(tmp_path, ["text_encoder"], "int4")


def test_auto_prefers_openvino_for_the_image_classifier_only():
    """Served, OpenVINO's BF16 is as fast as INT8 for EfficientNet-Lite0 at batch 1 and faster at 8
    (and closer to FP32); for text_encoder it is slower on short texts: INT8 stays its choice."""
    passed = ["fp32", "cpu_opt", "int8", "openvino"]
    assert variants.best_variant(passed, "cpu", "image_classifier") == "openvino"
    assert variants.best_variant(passed, "cpu", "text_encoder") == "int8"
    assert variants.best_variant(passed, "cpu") == "int8"
    # where the CPU has no BF16 products the variant is not built: the classifier serves INT8
    assert variants.best_variant(["fp32", "cpu_opt", "int8"], "cpu", "image_classifier") == "int8"
    assert variants.best_variant(passed + ["fp16"], "gpu", "image_classifier") == "fp16"


def test_auto_avoids_what_the_local_server_cannot_load(tmp_path):
    _fake_repo(tmp_path, ["fp32", "cpu_opt", "int8", "fp16", "trt_plan"])
    assert variants.resolve_precision(tmp_path, ["text_encoder"], "auto", gpu=True) == ("gpu", {"text_encoder": "trt_plan"})
    local = tuple(n for n in VARIANTS if n != "trt_plan")
    assert variants.resolve_precision(tmp_path, ["text_encoder"], "auto", gpu=True, loadable=local) == (
        "fp16",
        {"text_encoder": "fp16"},
    )


def test_no_config_for_a_model_whose_fp32_failed(tmp_path):
    model_dir = _fake_repo(tmp_path, [])
    assert not (model_dir / "configs" / "cpu.pbtxt").exists()
    assert variants.resolve_precision(tmp_path, ["text_encoder"], "auto", gpu=False) == ("cpu", {"text_encoder": "fp32"})


def test_variant_parameters_are_in_every_generated_config(tmp_path):
    text = variants.variant_config(ROOT_CONFIG, VARIANTS["int8"], {"weights_provenance": "random-init(seed=0)"})
    assert 'parameters { key: "weights_provenance" value: { string_value: "random-init(seed=0)" } }' in text
    fp32 = variants.variant_config(ROOT_CONFIG, VARIANTS["fp32"], {"weights_provenance": "x"})
    assert "default_model_filename" not in fp32 and "weights_provenance" in fp32


def test_auto_falls_back_to_fp32_when_no_variant_passed(tmp_path):
    model_dir = _fake_repo(tmp_path, ["fp32"])
    cpu = (model_dir / "configs" / "cpu.pbtxt").read_text()
    assert "default_model_filename" not in cpu
    assert variants.resolve_precision(tmp_path, ["text_encoder"], "auto", gpu=False) == ("cpu", {"text_encoder": "fp32"})


def test_remove_variant_deletes_file_and_config(tmp_path):
    model_dir = _fake_repo(tmp_path, ["fp32", "int8"])
    (model_dir / "1" / "model.int8.onnx").write_bytes(b"x")
    variants.remove_variant(model_dir, VARIANTS["int8"])
    assert not (model_dir / "1" / "model.int8.onnx").exists()
    assert not (model_dir / "configs" / "int8.pbtxt").exists()
