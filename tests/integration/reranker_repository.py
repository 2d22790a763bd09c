"""A copy of the model repository with the cross-encoder reranker exported into it, from a
random-init checkpoint (tests/unit/cross_encoder_checkpoint.py), by the real export path; and the
reference logits of that checkpoint (transformers). Shared by the tests that serve text_reranker."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from export import cross_encoder, pipeline
from server.layout import ROOT
from tests.unit.cross_encoder_checkpoint import make_checkpoint

# The reranker's own folders: real copies (the export writes into them); the rest are links.
OWN = ("text_reranker", "text_pair_tokenizer", "text_cross_encoder")


def export_reranker(base: Path) -> tuple[Path, Path]:
    """(repository, checkpoint): ``base/model_repository`` with text_reranker exported and gated."""
    repo = base / "model_repository"
    source = (ROOT / "model_repository").resolve()
    shutil.copytree(source, repo, copy_function=os.symlink, ignore=shutil.ignore_patterns("__pycache__", *OWN))
    for name in OWN:
        shutil.copytree(source / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    checkpoint = make_checkpoint(base / "checkpoint")
    report = pipeline.run(cross_encoder.TextCrossEncoderPipeline(checkpoint), repo, speed=False)
    assert [r["status"] for r in report["variants"]] == ["passed"], report
    return repo, checkpoint


class Reference:
    """transformers' logits of the exported checkpoint, its pairs tokenized as served."""

    def __init__(self, repo: Path, checkpoint: Path):
        self.model = cross_encoder.load_torch_model(checkpoint.resolve())
        self.tokenizer = cross_encoder.pair_tokenizer(cross_encoder.paths(repo)[1], repo)

    def scores(self, query: str, documents: list[str]) -> np.ndarray:
        return cross_encoder.torch_logits(self.model, self.tokenizer.encode(query, documents))
