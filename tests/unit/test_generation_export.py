"""export.generation: the gate on the real export, --weights refusals, atomic publication, reruns.

The real SmolLM2 GGUF is loaded once for the module (about 20 s); the exported folder that
`python -m export` writes is reused when it is there and complete, else the module exports
into a temporary repository. The --weights tests use a tiny random-init Llama with the real
tokenizer, so each export of it takes a second or two.
"""

from __future__ import annotations

import json
import time

import pytest

from export import generation
from server.layout import ROOT
from tests.unit.tiny_checkpoints import tiny_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def source():
    """(model, tokenizer) of the packaged GGUF, loaded once."""
    started = time.perf_counter()
    loaded = generation.load_source(generation.packaged_source())
    print(f"GGUF source loaded in {time.perf_counter() - started:.1f} s")
    return loaded


@pytest.fixture(scope="module")
def real_export(source, tmp_path_factory):
    repo = ROOT / "model_repository"
    if generation.up_to_date(repo, generation.packaged_source(), "float32"):
        print(f"reusing {generation.version_dir(repo)}")
        return generation.version_dir(repo)
    repo = tmp_path_factory.mktemp("repo")
    print(f"no complete export in model_repository/: exporting into {repo}")
    return generation.export(repo, loaded=source).version_dir


@pytest.fixture(scope="module")
def tiny_llama(real_export, tmp_path_factory):
    """A Llama checkpoint folder (random weights, 2 layers) with the real tokenizer."""
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), real_export, "llama", head_dim=16, max_position_embeddings=512)


def _hashes(folder):
    from python_backends.files import sha256_file

    return {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file()}


def test_gate_passes_on_the_real_export(source, real_export):
    model, tokenizer = source
    names = {p.name for p in real_export.iterdir()}
    assert set(generation.EXPORTED_FILES) | {generation.MANIFEST} <= names
    assert "gguf" not in (real_export / "config.json").read_text().lower()  # no quantization config left
    verdict = generation.gate(model, tokenizer, real_export)
    print(json.dumps(verdict, indent=1))
    assert verdict["passed"], verdict["failures"]
    assert verdict["logits_max_abs_diff"] <= 1e-5
    assert verdict["greedy_agree"] == verdict["prompts"] == len(generation.GATE_PROMPTS)
    # the weights are the real instruct model, not merely equal to themselves
    assert "Paris" in verdict["sample"]["greedy"], verdict["sample"]
    manifest = json.loads((real_export / generation.MANIFEST).read_text())
    assert manifest["dtype"] == "float32" and manifest["gate"]["passed"]
    assert manifest["source"]["kind"] == "gguf"


def test_the_gate_fails_on_other_weights_or_another_chat_template(tiny_llama, tmp_path):
    """The gate compares what it is given: weights 1 % off fail on the logits, a changed chat
    template on the template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = generation.export(tmp_path, weights=tiny_llama).version_dir
    model, tokenizer = generation.load_source(generation.weights_source(tiny_llama))
    assert generation.gate(model, tokenizer, exported)["passed"]
    other = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    with torch.no_grad():
        other.model.norm.weight.mul_(1.01)
    verdict = generation.gate(other, tokenizer, exported)
    assert not verdict["passed"] and verdict["logits_max_abs_diff"] > 1e-5
    assert any("logits max abs diff" in f for f in verdict["failures"]), verdict["failures"]
    changed = AutoTokenizer.from_pretrained(tiny_llama)
    changed.chat_template = changed.chat_template.replace("You are a helpful AI assistant", "You are an assistant")
    verdict = generation.gate(model, changed, exported)
    assert not verdict["passed"]
    assert "the chat template differs" in verdict["failures"], verdict["failures"]


def test_refuses_a_non_llama_folder_naming_both_architectures(tmp_path, capsys):
    weights = tmp_path / "gpt2"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (weights / "tokenizer.json").write_text("{}")
    repo = tmp_path / "repo"
    with pytest.raises(generation.GenerationExportError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        generation.export(repo, weights=weights)
    assert generation.main(["--weights", str(weights), "--repository", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "architecture GPT2LMHeadModel" in err and "supported: LlamaForCausalLM, Qwen2ForCausalLM" in err
    assert not repo.exists()
    (weights / "config.json").unlink()
    with pytest.raises(generation.GenerationExportError, match="no config.json"):
        generation.export(repo, weights=weights)


def test_weights_export_publishes_skips_when_up_to_date_and_survives_python_m_export(tiny_llama, tmp_path):
    repo = tmp_path / "repo"
    first = generation.export(repo, weights=tiny_llama)
    assert not first.skipped and first.metrics["passed"]
    assert first.metrics["logits_max_abs_diff"] == 0.0
    target = generation.version_dir(repo)
    assert {p.name for p in target.iterdir()} == {*generation.EXPORTED_FILES, generation.MANIFEST}
    assert not any(p.name.startswith(".") for p in target.parent.iterdir()), "staging folder left behind"
    before = _hashes(target)
    again = generation.export(repo, weights=tiny_llama)
    assert again.skipped and _hashes(target) == before
    # what `python -m export` runs keeps a user's checkpoint instead of the packaged model
    assert generation.export_for_serving(repo).skipped
    # another dtype, a changed source or a damaged file is not up to date
    assert not generation.up_to_date(repo, generation.weights_source(tiny_llama), "bfloat16")
    (target / "tokenizer_config.json").write_text("{}")
    assert not generation.up_to_date(repo)


def test_dtype_is_the_saved_weights_dtype(tiny_llama, tmp_path):
    from safetensors import safe_open

    result = generation.export(tmp_path, weights=tiny_llama, dtype="bfloat16")
    assert result.metrics["passed"], result.metrics
    with safe_open(str(result.version_dir / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    assert dtypes == {"BF16"}
    assert json.loads((result.version_dir / generation.MANIFEST).read_text())["dtype"] == "bfloat16"


def test_a_failed_gate_publishes_nothing(tiny_llama, tmp_path):
    repo = tmp_path / "repo"
    with pytest.raises(generation.GenerationExportError, match="gate failed"):
        generation.export(repo, weights=tiny_llama, max_abs_diff=-1.0)
    assert not generation.version_dir(repo).exists()
    assert list((repo / generation.MODEL).iterdir()) == [], "staging folder left behind"
    # Into an existing version folder (model.py is source and lives there): a failed gate
    # leaves the previous export and model.py as they were; a passing one keeps model.py.
    generation.export(repo, weights=tiny_llama)
    target = generation.version_dir(repo)
    (target / "model.py").write_text("# the served model's shim\n")
    before = _hashes(target)
    with pytest.raises(generation.GenerationExportError, match="gate failed"):
        generation.export(repo, weights=tiny_llama, force=True, max_abs_diff=-1.0)
    assert _hashes(target) == before
    assert generation.up_to_date(repo)
    result = generation.export(repo, weights=tiny_llama, dtype="float16")
    assert not result.skipped
    assert (target / "model.py").read_text() == "# the served model's shim\n"
    assert generation.up_to_date(repo, generation.weights_source(tiny_llama), "float16")


def test_gpu_config_is_config_pbtxt_on_a_gpu_instance(tmp_path):
    from export.generation import GenerationExportError, write_gpu_config

    repo = tmp_path / "repo"
    (repo / "text_generation").mkdir(parents=True)
    source = (ROOT / "model_repository" / "text_generation" / "config.pbtxt").read_text()
    (repo / "text_generation" / "config.pbtxt").write_text(source)
    out = write_gpu_config(repo)
    text = out.read_text()
    assert "kind: KIND_GPU" in text and "KIND_CPU" not in text
    assert text.splitlines()[1:] == source.replace("KIND_CPU", "KIND_GPU").splitlines()
    (repo / "text_generation" / "config.pbtxt").write_text(source.replace("kind: KIND_CPU", "kind: KIND_GPU"))
    with pytest.raises(GenerationExportError, match="KIND_CPU"):
        write_gpu_config(repo)
