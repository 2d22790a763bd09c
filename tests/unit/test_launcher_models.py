"""The launcher reports the precision variant of every model a request reaches."""

from __future__ import annotations

from server.__main__ import _served_models
from server.layout import ROOT
from server.process import DEFAULT_MODELS


def test_variant_models_are_found_through_ensembles_and_bls_targets():
    repo = ROOT / "model_repository"
    # text_embedding reaches text_encoder through the canary router's load_with (a BLS call),
    # not as an ensemble step; it must still be reported. variants.json comes from the export.
    assert _served_models(repo, DEFAULT_MODELS) == ["text_encoder", "image_classifier"]
    assert _served_models(repo, ("text_embedding_cached",)) == ["text_encoder"]
