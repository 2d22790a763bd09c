"""export/pipeline.py with a toy model: gates decide what survives, reruns reuse, reports say why."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from export import pipeline, variants

CONFIG = """
name: "toy"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def _toy_onnx(path: Path, scale: float) -> None:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "s"], ["y"])],
        "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [scale])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


class ToyPipeline:
    """fp32 = x * 1; int8 'quantization' = x * (1 + error); cpu_opt exact; trt_plan never buildable."""

    name = "toy"
    variants = ("cpu_opt", "int8", "trt_plan")
    builder_version = 1
    bench_batches = (1, 4)

    def __init__(self, int8_error: float):
        self.int8_error = int8_error
        self.builds: list[str] = []

    def export_fp32(self, repo, force):
        d = repo / "toy" / "1"
        d.mkdir(parents=True, exist_ok=True)
        (repo / "toy" / "config.pbtxt").write_text(CONFIG)
        if not (d / "model.onnx").exists() or force:
            _toy_onnx(d / "model.onnx", 1.0)

    def skip_reason(self, variant):
        return "no GPU in this test" if variant == "trt_plan" else None

    def build(self, variant, version_dir, dst):
        self.builds.append(variant)
        _toy_onnx(dst, 1.0 + (self.int8_error if variant == "int8" else 0.0))

    def evaluate(self, variant, path):
        import onnxruntime as ort

        x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
        y = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
        return {"prob_diff": float(np.abs(y - x).max())}

    def bench_feed(self, batch):
        return {"x": np.ones((batch, 4), dtype=np.float32)}

    def describe(self):
        return {"summary": "toy"}


@pytest.fixture(autouse=True)
def toy_gates(monkeypatch, tmp_path):
    gates = {"toy": {"fp32": {"max_prob_diff": 1e-6}, "cpu_opt": {"max_prob_diff": 1e-6}, "int8": {"max_prob_diff": 0.01}}}
    monkeypatch.setattr(variants, "load_gates", lambda path=None: gates)
    monkeypatch.setattr(pipeline, "REPORTS", tmp_path / "reports")


def test_passing_variants_get_configs_and_the_best_is_chosen(tmp_path):
    report = pipeline.run(ToyPipeline(int8_error=0.001), tmp_path, speed=False)
    status = {r["variant"]: r["status"] for r in report["variants"]}
    assert status == {"fp32": "passed", "cpu_opt": "passed", "int8": "passed", "trt_plan": "skipped"}
    assert (tmp_path / "toy" / "configs" / "int8.pbtxt").is_file()
    assert "model.int8.onnx" in (tmp_path / "toy" / "configs" / "cpu.pbtxt").read_text()
    assert report["serving_choice"] == {"cpu": "int8", "gpu": "fp32"}
    skipped = next(r for r in report["variants"] if r["variant"] == "trt_plan")
    assert skipped["reason"] == "no GPU in this test"
    assert "| int8 | passed |" in pipeline.to_markdown(report)
    assert not (tmp_path / "reports" / "toy.json").exists()  # no timing: the full report is not replaced


def test_a_variant_that_misses_its_gate_is_removed_and_never_served(tmp_path):
    report = pipeline.run(ToyPipeline(int8_error=0.5), tmp_path, speed=False)
    int8 = next(r for r in report["variants"] if r["variant"] == "int8")
    assert int8["status"] == "failed" and "prob_diff = 0.5 > 0.01" in int8["reason"]
    assert not (tmp_path / "toy" / "1" / "model.int8.onnx").exists()
    assert not (tmp_path / "toy" / "configs" / "int8.pbtxt").exists()
    # auto on a CPU then serves the next best that passed
    assert report["serving_choice"]["cpu"] == "cpu_opt"
    assert variants.resolve_precision(tmp_path, ["toy"], "auto", gpu=False) == ("cpu", {"toy": "cpu_opt"})


def test_rerun_reuses_what_is_up_to_date_and_force_rebuilds(tmp_path):
    first = ToyPipeline(0.001)
    pipeline.run(first, tmp_path, speed=False)
    assert first.builds == ["cpu_opt", "int8"]
    second = ToyPipeline(0.001)
    pipeline.run(second, tmp_path, speed=False)
    assert second.builds == []
    # a tampered variant file is rebuilt
    (tmp_path / "toy" / "1" / "model.int8.onnx").write_bytes(b"junk")
    third = ToyPipeline(0.001)
    pipeline.run(third, tmp_path, speed=False)
    assert third.builds == ["int8"]
    forced = ToyPipeline(0.001)
    pipeline.run(forced, tmp_path, force=True, speed=False)
    assert forced.builds == ["cpu_opt", "int8"]


def test_speed_is_measured_side_by_side_with_ratios(tmp_path):
    report = pipeline.run(ToyPipeline(0.001), tmp_path, speed=True, bench_seconds=0.02)
    assert json.loads((tmp_path / "reports" / "toy.json").read_text())["model"] == "toy"
    table = [line for line in pipeline.to_markdown(report).splitlines() if line.startswith("|")]
    assert len({line.count(" | ") for line in table}) == 1, "header and rows must have the same columns"
    rows = {r["variant"]: r for r in report["variants"]}
    for name in ("fp32", "cpu_opt", "int8"):
        speed = rows[name]["speed"]
        assert speed["latency_ms_b1"] > 0 and speed["best_batch"] in (1, 4)
        assert rows[name]["speedup_vs_fp32_b1"] > 0
    assert "speed" not in rows["trt_plan"]


def test_ungated_variant_is_measured_reported_but_never_served(tmp_path):
    toy = ToyPipeline(int8_error=0.5)
    toy.ungated_reason = lambda variant: "random weights" if variant == "int8" else None
    report = pipeline.run(toy, tmp_path, speed=True, bench_seconds=0.02)
    int8 = next(r for r in report["variants"] if r["variant"] == "int8")
    assert int8["status"] == "ungated" and int8["reason"].startswith("random weights")
    assert "gate would say: prob_diff = 0.5 > 0.01" in int8["reason"]
    assert "speed" in int8  # measured for the report
    assert not (tmp_path / "toy" / "configs" / "int8.pbtxt").exists()
    assert report["serving_choice"]["cpu"] == "cpu_opt"
    # reruns reuse it without rebuilding, still not served
    again = ToyPipeline(int8_error=0.5)
    again.ungated_reason = toy.ungated_reason
    pipeline.run(again, tmp_path, speed=False)
    assert again.builds == [] and not (tmp_path / "toy" / "configs" / "int8.pbtxt").exists()


def test_a_variant_without_a_gate_is_an_error_and_not_served(tmp_path, monkeypatch):
    monkeypatch.setattr(variants, "load_gates", lambda path=None: {"toy": {"fp32": {"max_prob_diff": 1e-6}}})
    report = pipeline.run(ToyPipeline(int8_error=0.0), tmp_path, speed=False)
    rows = {r["variant"]: r for r in report["variants"]}
    assert rows["int8"]["status"] == "error" and "no [toy.int8] gate" in rows["int8"]["reason"]
    assert not (tmp_path / "toy" / "configs" / "int8.pbtxt").exists()
    assert report["serving_choice"]["cpu"] == "fp32"


def test_fp32_that_misses_its_gate_is_removed_and_nothing_is_derived(tmp_path, monkeypatch):
    monkeypatch.setattr(variants, "load_gates", lambda path=None: {"toy": {"fp32": {"max_prob_diff": -1.0}}})
    toy = ToyPipeline(0.0)
    report = pipeline.run(toy, tmp_path, speed=False)
    assert [r["variant"] for r in report["variants"]] == ["fp32"] and toy.builds == []
    assert not (tmp_path / "toy" / "1" / "model.onnx").exists()
    assert not (tmp_path / "toy" / "configs" / "cpu.pbtxt").exists()


def test_a_failed_rebuild_keeps_nothing_half_built(tmp_path):
    pipeline.run(ToyPipeline(0.001), tmp_path, speed=False)
    good = (tmp_path / "toy" / "1" / "model.int8.onnx").read_bytes()
    pipeline.run(ToyPipeline(0.5), tmp_path, force=True, speed=False)
    assert not list((tmp_path / "toy" / "1").glob("*.candidate"))
    # the failed candidate never replaced the file in place before the gate; failure removes the variant
    assert not (tmp_path / "toy" / "1" / "model.int8.onnx").exists()
    assert good  # the earlier, passing build existed


def test_partial_run_drops_variants_built_from_an_older_fp32(tmp_path):
    pipeline.run(ToyPipeline(0.001), tmp_path, speed=False)
    assert (tmp_path / "toy" / "configs" / "cpu_opt.pbtxt").exists()
    _toy_onnx(tmp_path / "toy" / "1" / "model.onnx", 1.0000002)  # a new FP32 model (within its gate)
    report = pipeline.run(ToyPipeline(0.001), tmp_path, speed=False, only=("int8",))
    assert "cpu_opt" not in {r["variant"] for r in report["variants"]}
    assert not (tmp_path / "toy" / "configs" / "cpu_opt.pbtxt").exists()
    assert not (tmp_path / "toy" / "1" / "model.opt.onnx").exists()
