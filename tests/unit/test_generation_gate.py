"""The generation model's precision variants: their gate on the exported SmolLM2 weights, and
the configs that make a passed variant servable (export/generation_gate.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from export import generation_gate, variants
from python_backends.generation import linear

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "model_repository" / "text_generation" / "1"
EXPORTED = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").is_file(), reason="text_generation weights not exported (python -m export.generation)"
)
QUANTIZED = [p for p in linear.runnable_precisions() if p != "fp32"]


@pytest.fixture(scope="module")
def heldout():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    texts = {t["name"]: t["text"] for t in generation_gate.heldout_texts()}
    # one prose language, one non-Latin script, one program: the gate's full set runs at export
    return [tokenizer.encode(texts[name]) for name in ("french", "chinese", "python")]


@pytest.fixture(scope="module")
def reference(heldout):
    return generation_gate._passes(generation_gate._runner(MODEL_DIR, "fp32"), heldout)


def test_heldout_text_covers_languages_and_code():
    names = {t["name"] for t in generation_gate.heldout_texts()}
    assert {"english", "french", "german", "chinese", "python", "chat"} <= names


@EXPORTED
@pytest.mark.skipif(not QUANTIZED, reason=f"only fp32 is offered on this CPU ({linear.describe_cpu()})")
@pytest.mark.parametrize("precision", QUANTIZED)
def test_each_variant_passes_its_gate_in_both_kernel_paths(precision, heldout, reference):
    gate = variants.load_gates()["text_generation"][precision]
    passes = generation_gate._passes(generation_gate._runner(MODEL_DIR, precision), heldout)
    for chunk, logits in passes.items():  # prompt-sized chunks and decode-sized ones
        metrics = generation_gate.compare(reference[chunk], logits, heldout)
        assert variants.check_gate(metrics, gate) == [], (chunk, metrics)
        # the gate sees a real difference (FP16 weights may keep every top-1 token: KL still moves)
        assert metrics["mean_kl"] > 0 and (metrics["top1_agreement"] < 1.0 or precision == "fp16_fp32"), (chunk, metrics)


@EXPORTED
@pytest.mark.skipif(not QUANTIZED, reason=f"only fp32 is offered on this CPU ({linear.describe_cpu()})")
@pytest.mark.parametrize("precision", QUANTIZED)
def test_each_variant_answers_the_chat_question(precision):
    from python_backends.generation.engine import LLMEngine
    from python_backends.generation.engine_config import EngineConfig
    from python_backends.generation.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir=MODEL_DIR, weights_precision=precision, num_blocks=64))
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    [(text, _)] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    assert text.strip() == "The capital of France is Paris."
    assert engine.weights.nbytes() < 0.9 * 4 * 134_515_008  # less than the FP32 weights


def test_compare_figures_on_known_distributions():
    import torch

    ref = [torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])]
    same = generation_gate.compare(ref, ref, [[0, 1]])
    assert same["top1_agreement"] == 1.0 and same["mean_kl"] == pytest.approx(0.0, abs=1e-7)
    assert same["ppl_ratio"] == pytest.approx(1.0)
    flipped = generation_gate.compare(ref, [torch.tensor([[0.0, 2.0, 0.0], [0.0, 3.0, 0.0]])], [[0, 1]])
    assert flipped["top1_agreement"] == 0.5 and flipped["mean_kl"] > 0.5 and flipped["ppl_ratio"] < 1.0


@pytest.fixture
def repo(tmp_path):
    folder = tmp_path / "text_generation"
    folder.mkdir()
    shutil.copy(ROOT / "model_repository" / "text_generation" / "config.pbtxt", folder / "config.pbtxt")
    return tmp_path


def _settings(path: Path) -> dict:
    from contract.model_config import ModelConfig
    from ops.configs import config_from_disk
    from python_backends.generation.serving import engine_settings

    cfg = ModelConfig(config_from_disk(path.parents[2], "text_generation", path.stem))
    return engine_settings(cfg.param, cfg.param_int, cfg.param_bool)


def test_passed_variants_get_configs_and_the_best_serves_auto(repo):
    configs = repo / "text_generation" / "configs"
    configs.mkdir()
    (configs / "bf16.pbtxt").write_text("stale: a variant that passed once")
    generation_gate.write_configs(repo, ["fp32", "int4_bf16"], "int4_bf16")
    assert sorted(p.name for p in configs.iterdir()) == ["cpu.pbtxt", "fp32.pbtxt", "int4_bf16.pbtxt"]
    assert _settings(configs / "cpu.pbtxt")["weights_precision"] == "int4_bf16"
    assert _settings(configs / "fp32.pbtxt")["weights_precision"] == "fp32"
    base = _settings(repo / "text_generation" / "configs" / "none.pbtxt")  # config.pbtxt itself
    assert base["weights_precision"] == "fp32"
    assert {k: v for k, v in _settings(configs / "cpu.pbtxt").items() if k != "weights_precision"} == {
        k: v for k, v in base.items() if k != "weights_precision"
    }
    variants.write_manifest(repo, "text_generation", {"best": {"cpu": "int4_bf16", "gpu": "fp32"}, "variants": {}})
    assert variants.resolve_precision(repo, ["text_generation"], "auto", gpu=False) == ("cpu", {"text_generation": "int4_bf16"})
    # what the launcher passes: the local server loads no trt_plan, and every generation variant
    local = tuple(name for name in variants.VARIANTS if name != "trt_plan")
    assert variants.resolve_precision(repo, ["text_generation"], "auto", gpu=False, loadable=local) == (
        "cpu",
        {"text_generation": "int4_bf16"},
    )
    assert variants.resolve_precision(repo, ["text_generation"], "int4_bf16") == ("int4_bf16", {"text_generation": "int4_bf16"})
    assert variants.resolve_precision(repo, ["text_generation"], "bf16") == ("bf16", {"text_generation": "fp32"})
    assert variants.resolve_precision(repo, ["text_generation"], "fp32") == ("fp32", {"text_generation": "fp32"})
    generation_gate.write_configs(repo, ["fp32"], "fp32")  # the variant failed on another CPU
    assert not (configs / "int4_bf16.pbtxt").exists()
    assert _settings(configs / "cpu.pbtxt")["weights_precision"] == "fp32"


def test_a_config_without_its_precision_line_is_refused():
    with pytest.raises(ValueError, match="one weights_precision parameter line"):
        generation_gate.variant_config('name: "text_generation"\n', "bf16", "")


def test_the_verdicts_are_trusted_only_for_the_same_kernels_and_weights(repo):
    assert not generation_gate.up_to_date(repo, "abc")
    variants.write_manifest(
        repo,
        "text_generation",
        {**generation_gate.fingerprint(), "weights_sha256": "abc", "variants": {"fp32": {"status": "passed"}}},
    )
    assert generation_gate.up_to_date(repo, "abc")
    assert not generation_gate.up_to_date(repo, "def")  # other weights
    manifest = variants.read_manifest(repo, "text_generation")
    variants.write_manifest(repo, "text_generation", {**manifest, "kernels": "another CPU"})
    assert not generation_gate.up_to_date(repo, "abc")


def test_the_up_to_date_path_rewrites_configs_and_other_weights_drop_them(repo, monkeypatch):
    """An edit of config.pbtxt reaches configs/cpu.pbtxt without a new gate; BF16 weights get no variants."""
    from export import generation

    folder = repo / "text_generation"
    variants.write_manifest(
        repo,
        "text_generation",
        {
            **generation_gate.fingerprint(),
            "weights_sha256": "abc",
            "best": {"cpu": "bf16", "gpu": "fp32"},
            "variants": {"fp32": {"status": "passed"}, "bf16": {"status": "passed"}},
        },
    )
    exported = {"dtype": "float32", "files": {"model.safetensors": "abc"}}
    monkeypatch.setattr(generation, "read_manifest", lambda _repo: exported)
    (folder / "config.pbtxt").write_text(
        (folder / "config.pbtxt")
        .read_text()
        .replace('key: "max_num_seqs" value: { string_value: "32" }', 'key: "max_num_seqs" value: { string_value: "8" }')
    )
    generation.gate_precisions(repo)
    assert _settings(folder / "configs" / "cpu.pbtxt")["max_num_seqs"] == 8
    assert _settings(folder / "configs" / "cpu.pbtxt")["weights_precision"] == "bf16"
    exported["dtype"] = "bfloat16"
    assert generation.gate_precisions(repo) == {}
    assert sorted(p.name for p in (folder / "configs").iterdir()) == []
    assert not variants.manifest_path(repo, "text_generation").exists()


def test_a_failed_build_is_a_failed_row_in_the_report():
    text = generation_gate.markdown(
        {
            "cpu": "x",
            "best": {"cpu": "fp32"},
            "variants": {"int4_bf16": {"status": "failed", "metrics": {}, "failures": ["build: ConfigError: blocks of 32"]}},
        }
    )
    assert "| int4_bf16 | failed: build: ConfigError: blocks of 32 |" in text


def test_the_probe_picks_the_fastest_product_and_never_a_llama_variant(monkeypatch, tmp_path):
    """choose_best on given probe figures: the best product of the speeds relative to the fastest at each
    concurrency among the PyTorch variants; a faster llama_* variant is recorded but not chosen."""
    figures = {
        "llama_bf16": {1: 95.0, 16: 470.0},
        "int4_bf16": {1: 45.0, 16: 300.0},
        "fp16_fp32": {1: 50.0, 16: 200.0},
        "fp32": {1: 18.0, 16: 130.0},
    }
    monkeypatch.setattr(generation_gate, "probe_speeds", lambda model_dir, precision: figures[precision])
    rows = {p: {} for p in figures}
    assert generation_gate.choose_best(tmp_path, list(figures), rows) == "int4_bf16"  # 0.90 x 1.0 > 1.0 x 0.67
    assert rows["llama_bf16"]["probe_tokens_per_s"] == {"1": 95.0, "16": 470.0}
    assert set(generation_gate.AUTO_EXCLUDED) == {p for p in variants.GENERATION_VARIANTS if p.startswith("llama_")}


def test_the_probe_keeps_each_candidates_best_of_two_interleaved_rounds(monkeypatch, tmp_path):
    """A busy neighbour slowed ov_int4_f16's first probe: its second, in reversed order, counts. Excluded
    variants are probed once; one whose probe fails is neither probed again nor chosen."""
    figures = {
        "ov_int4_f16": [{1: 30.0, 16: 250.0}, {1: 80.0, 16: 520.0}],
        "ov_f16": [{1: 55.0, 16: 530.0}, {1: 50.0, 16: 500.0}],
        "llama_bf16": [{1: 90.0, 16: 460.0}],
        "bf16": [RuntimeError("no BF16 here")],
    }
    calls: list[str] = []

    def probe(model_dir, precision):
        calls.append(precision)
        figure = figures[precision][sum(1 for c in calls if c == precision) - 1]
        if isinstance(figure, Exception):
            raise figure
        return dict(figure)

    monkeypatch.setattr(generation_gate, "probe_speeds", probe)
    rows = {p: {} for p in figures}
    assert generation_gate.choose_best(tmp_path, list(figures), rows) == "ov_int4_f16"
    assert calls == ["ov_int4_f16", "ov_f16", "llama_bf16", "bf16", "ov_f16", "ov_int4_f16"]
    assert rows["ov_int4_f16"]["probe_tokens_per_s"] == {"1": 80.0, "16": 520.0}
    assert rows["ov_f16"]["probe_tokens_per_s"] == {"1": 55.0, "16": 530.0}  # the best of each concurrency
    assert "probe_tokens_per_s" not in rows["bf16"]


@EXPORTED
def test_the_probe_runs_in_a_process_of_its_own_and_reports_each_concurrency():
    speeds = generation_gate.probe_speeds(MODEL_DIR, "fp32", steps=2)
    assert set(speeds) == set(generation_gate.PROBE_STREAMS) and all(v > 0 for v in speeds.values())
    with pytest.raises(RuntimeError, match="probe's process exited"):
        generation_gate.probe_speeds(MODEL_DIR, "no_such_precision", steps=2)
