"""The launcher reports the precision variant of every model a request reaches.

On a copy of the repository's configs in a temporary folder, with variants.json written here:
the unit tier needs no export output (variants.json is what `make export` writes)."""

from __future__ import annotations

import json
import shutil

from server.__main__ import _served_models
from server.layout import ROOT
from server.process import DEFAULT_MODELS


def _configs_only(tmp_path, with_variants=("text_encoder", "image_classifier")):
    repo = tmp_path / "model_repository"
    for config in (ROOT / "model_repository").glob("*/config.pbtxt"):
        (repo / config.parent.name).mkdir(parents=True)
        shutil.copy2(config, repo / config.parent.name / "config.pbtxt")
    for model in with_variants:
        (repo / model / "variants.json").write_text(json.dumps({"model": model, "variants": {}}))
    return repo


def test_variant_models_are_found_through_ensembles_and_bls_targets(tmp_path):
    repo = _configs_only(tmp_path)
    # text_embedding reaches text_encoder through the canary router's load_with (a BLS call),
    # not as an ensemble step; it must still be reported.
    assert _served_models(repo, DEFAULT_MODELS) == ["text_encoder", "image_classifier"]
    assert _served_models(repo, ("text_embedding_cached",)) == ["text_encoder"]


def test_only_models_with_variants_are_reported(tmp_path):
    repo = _configs_only(tmp_path, with_variants=("image_classifier",))
    assert _served_models(repo, DEFAULT_MODELS) == ["image_classifier"]
    assert _served_models(_configs_only(tmp_path / "none", with_variants=()), DEFAULT_MODELS) == []
