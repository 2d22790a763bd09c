"""A second architecture on the engine: Qwen2 (Llama with a bias on the query, key and value
projections), a tiny random-init checkpoint built here with transformers and the exported
SmolLM2 tokenizer, against transformers' own forward and generate()."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.errors import ConfigError
from tests.unit.tiny_checkpoints import tiny_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "text_generation" / "1"
pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "tokenizer.json").is_file(), reason="text_generation not exported (python -m export.generation)"
)


def build_tiny_qwen2(folder: Path) -> Path:
    """A 2-layer Qwen2ForCausalLM with random weights and random (non-zero) q/k/v biases."""
    return tiny_checkpoint(folder, MODEL_DIR, "qwen2", max_position_embeddings=4096)  # config.pbtxt's max_model_len


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


def test_the_engine_runs_qwen2_as_transformers_does(tiny_qwen2):
    from python_backends.generation.engine import LLMEngine
    from python_backends.generation.engine_config import EngineConfig
    from python_backends.generation.model_runner import LlamaConfig
    from python_backends.generation.sampling import SamplingParams

    assert LlamaConfig.from_folder(tiny_qwen2).qkv_bias
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_qwen2)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    engine = LLMEngine(
        EngineConfig(
            model_dir=tiny_qwen2, num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512
        ),
        tokenizer=tokenizer,
    )
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
        for m in ("What is the capital of France?", "Écris une phrase sur la mer.", "def fibonacci(n):")
    ]
    want = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        want.append(out[0, ids.shape[1] :].tolist())
    got = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))  # batched
    assert [ids for _, ids in got] == want


def test_qwen2_with_a_sliding_window_is_refused_naming_the_field(tiny_qwen2, tmp_path):
    from python_backends.generation.model_runner import LlamaConfig

    config = json.loads((tiny_qwen2 / "config.json").read_text())
    with pytest.raises(ConfigError, match="use_sliding_window"):
        LlamaConfig.from_dict({**config, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        LlamaConfig.from_dict({**config, "architectures": ["GPT2LMHeadModel"]})
