"""The launcher reports the precision variant of every model a request reaches.

On a copy of the repository's configs in a temporary folder, with variants.json written here:
the unit tier needs no export output (variants.json is what `make export` writes)."""

from __future__ import annotations

import json
import shutil

from server.layout import ROOT
from server.models import DEFAULT_MODELS, variant_models


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
    # text_embedding reaches text_encoder as its step, text_embedding_cached through load_with
    # (a BLS call) and text_embedding; both must be reported.
    assert variant_models(repo, DEFAULT_MODELS) == ["text_encoder", "image_classifier"]
    assert variant_models(repo, ("text_embedding_cached",)) == ["text_encoder"]


def test_only_models_with_variants_are_reported(tmp_path):
    repo = _configs_only(tmp_path, with_variants=("image_classifier",))
    assert variant_models(repo, DEFAULT_MODELS) == ["image_classifier"]
    assert variant_models(_configs_only(tmp_path / "none", with_variants=()), DEFAULT_MODELS) == []


def test_text_generation_is_a_default_model_once_its_folder_is_in_the_repository(tmp_path):
    from server.__main__ import parse_args
    from server.models import default_models, with_dependencies
    from server.process import ServerOptions

    repo = _configs_only(tmp_path)
    if not (repo / "text_generation" / "config.pbtxt").is_file():  # before the served model lands
        (repo / "text_generation").mkdir(exist_ok=True)
        (repo / "text_generation" / "config.pbtxt").write_text('name: "text_generation"\nbackend: "python"\n')
    assert default_models(repo) == DEFAULT_MODELS
    assert DEFAULT_MODELS[-1] == "text_generation"
    assert ServerOptions(model_repository=repo).models == DEFAULT_MODELS
    # it reaches no model with precision variants, so the variant report is unchanged
    assert variant_models(repo, default_models(repo)) == ["text_encoder", "image_classifier"]
    # tritonserver is told to load it (explicit model control: the --load-model list)
    assert "text_generation" in with_dependencies(repo, ServerOptions(model_repository=repo).models)
    # named models are loaded as named
    assert parse_args(["--model", "text_embedding"]).models == ["text_embedding"]
    assert ServerOptions(model_repository=repo, models=("text_embedding",)).models == ("text_embedding",)
    # a repository without the generation model still serves the others by default
    (repo / "text_generation" / "config.pbtxt").unlink()
    assert default_models(repo) == tuple(m for m in DEFAULT_MODELS if m != "text_generation")
    assert ServerOptions(model_repository=repo).models == default_models(repo)
