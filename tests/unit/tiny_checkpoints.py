"""Tiny random-init causal LMs (2 layers, hidden 64) with a real tokenizer, saved as Hugging Face
checkpoint folders: what the --weights tests export, in each architecture the engine runs."""

from __future__ import annotations

from pathlib import Path

# Shared by every architecture: SmolLM2's vocabulary and special tokens, 4 query / 2 KV heads.
SHAPE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def tiny_checkpoint(folder: Path, tokenizer_dir: Path, architecture: str, **config) -> Path:
    """``architecture`` "llama" or "qwen2" (its q/k/v biases random, not transformers' zeros, so a
    missing bias shows), seed 0; ``config`` overrides the shared shape."""
    import torch
    import transformers

    torch.manual_seed(0)
    if architecture == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SHAPE, **config}))
    elif architecture == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**SHAPE, **config}))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    else:
        raise ValueError(f"architecture {architecture!r}: llama or qwen2")
    model.eval().save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder
