"""The gateway's models and their limits, read from the model repository's config.pbtxt files
(openai_gateway/catalog.py); no server. A changed copy of the repository shows that the
configs, not the code, decide the limits."""

import re
import shutil
from pathlib import Path

import pytest

from openai_gateway.catalog import Catalog, CatalogError, EmbeddingModel, GenerationModel, RerankerModel

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = ROOT / "model_repository"


def _param(config_file: Path, key: str) -> str:
    """A parameter of a config.pbtxt, read with a regex (independently of the catalog's parser)."""
    text = config_file.read_text()
    m = re.search(r'key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    assert m, f"{key} not in {config_file}"
    return m.group(1)


def _copy_configs(target: Path) -> Path:
    """The repository's config.pbtxt files only (the catalog reads nothing else)."""
    for config in REPOSITORY.glob("*/config.pbtxt"):
        (target / config.parent.name).mkdir(parents=True)
        shutil.copy(config, target / config.parent.name / "config.pbtxt")
    return target


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} in {path}"
    path.write_text(text.replace(old, new))


@pytest.fixture(scope="module")
def catalog():
    return Catalog.from_repository(REPOSITORY)


def test_the_served_models_are_the_embedding_ensemble_the_generation_model_and_the_reranker(catalog):
    # image_classification is an ensemble too, but not a text embedding one; the other
    # models are steps of these. The reranker is listed; the gateway serves it only while
    # Triton has it ready (it is exported on request).
    assert set(catalog.models) == {"text_embedding", "text_generation", "text_reranker"}
    assert [m.id for m in catalog.of_kind("embedding")] == ["text_embedding"]
    assert [m.id for m in catalog.of_kind("generation")] == ["text_generation"]
    assert [m.id for m in catalog.of_kind("reranker")] == ["text_reranker"]


def test_text_reranker_limits_from_its_pair_tokenizers_config(catalog, tmp_path):
    m = catalog.models["text_reranker"]
    assert isinstance(m, RerankerModel)
    tokenizer_config = REPOSITORY / "text_pair_tokenizer" / "config.pbtxt"
    assert m.max_documents == int(_param(tokenizer_config, "max_documents")) == 64
    assert m.max_tokens == int(_param(tokenizer_config, "max_sequence_length")) == 512
    assert m.truncation == _param(tokenizer_config, "truncation") == "refuse"
    assert catalog.triton_models(m) == ("text_reranker", "text_pair_tokenizer", "text_cross_encoder")
    repo = _copy_configs(tmp_path)
    _edit(repo / "text_pair_tokenizer" / "config.pbtxt", 'value: { string_value: "64" }', 'value: { string_value: "16" }')
    changed = Catalog.from_repository(repo).models["text_reranker"]
    assert isinstance(changed, RerankerModel) and changed.max_documents == 16


def test_text_embedding_from_its_configs(catalog):
    m = catalog.models["text_embedding"]
    assert isinstance(m, EmbeddingModel)
    assert m.text_entry == "text_embedding_cached"  # the result cache by default
    assert m.ids_entry == "text_encoder"  # the ensemble's encoder step (no router outside a rollout)
    assert m.ids_output == "sentence_embedding"
    assert m.max_batch_size == 64
    assert m.ids_max_batch_size == 64
    assert m.max_tokens == 256
    assert m.buckets == (16, 32, 64, 128, 256)
    assert m.dimensions == 384
    assert m.tokenizer_file == REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json"
    tokenizer_config = REPOSITORY / "text_tokenizer" / "config.pbtxt"
    assert m.max_tokens == int(_param(tokenizer_config, "max_sequence_length"))
    assert m.buckets == tuple(int(b) for b in _param(tokenizer_config, "sequence_buckets").split(","))
    # Every Triton model a request reaches must be ready before it is sent.
    assert catalog.triton_models(m) == ("text_embedding_cached", "text_embedding", "text_encoder")


def test_text_generation_limits_from_its_config(catalog):
    m = catalog.models["text_generation"]
    assert isinstance(m, GenerationModel)
    config = REPOSITORY / "text_generation" / "config.pbtxt"
    assert m.max_model_len == int(_param(config, "max_model_len")) == 4096
    assert catalog.triton_models(m) == ("text_generation",)


@pytest.mark.parametrize(
    "name, kind, expected",
    [
        ("text_embedding", "embedding", "text_embedding"),
        ("sentence-transformers/all-MiniLM-L6-v2", "embedding", "text_embedding"),
        ("all-MiniLM-L6-v2", "embedding", "text_embedding"),
        ("text_generation", "generation", "text_generation"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "generation", "text_generation"),
        ("SmolLM2-135M-Instruct", "generation", "text_generation"),
        # The right name for the wrong endpoint is not found: an embedding model cannot chat.
        ("text_embedding", "generation", None),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "embedding", None),
        # Steps of the ensemble are not OpenAI models, nor are unknown or non-string names.
        ("text_embedding_cached", "embedding", None),
        ("text_tokenizer", "embedding", None),
        ("gpt-4o", "generation", None),
        ("Text_Embedding", "embedding", None),
        ("", "embedding", None),
        (None, "embedding", None),
        (42, "embedding", None),
        (["text_embedding"], "embedding", None),
    ],
)
def test_find_by_id_or_alias_and_kind(catalog, name, kind, expected):
    found = catalog.find(name, kind)
    assert (found.id if found is not None else None) == expected


def test_aliases_are_the_hugging_face_names(catalog):
    assert "sentence-transformers/all-MiniLM-L6-v2" in catalog.models["text_embedding"].aliases
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in catalog.models["text_generation"].aliases


def test_config_pbtxt_is_the_source_of_truth(tmp_path):
    repo = _copy_configs(tmp_path / "repo")
    _edit(repo / "text_embedding_cached" / "config.pbtxt", "max_batch_size: 64", "max_batch_size: 8")
    _edit(repo / "text_encoder" / "config.pbtxt", "max_batch_size: 64", "max_batch_size: 4")
    _edit(repo / "text_tokenizer" / "config.pbtxt", 'string_value: "256"', 'string_value: "128"')
    _edit(repo / "text_tokenizer" / "config.pbtxt", '"16,32,64,128,256"', '"128,32"')
    _edit(repo / "text_generation" / "config.pbtxt", 'string_value: "4096"', 'string_value: "1024"')

    catalog = Catalog.from_repository(repo)
    e = catalog.models["text_embedding"]
    assert (e.max_batch_size, e.ids_max_batch_size, e.max_tokens, e.buckets) == (8, 4, 128, (32, 128))
    assert e.tokenizer_file == repo / "text_tokenizer" / "1" / "tokenizer.json"
    g = catalog.models["text_generation"]
    assert g.max_model_len == 1024


def test_embedding_entry_direct_uses_the_ensemble(tmp_path):
    repo = _copy_configs(tmp_path / "repo")
    # Different batch limits for the ensemble and the cache entry, so the test can tell them apart.
    _edit(repo / "text_embedding" / "config.pbtxt", "max_batch_size: 64", "max_batch_size: 32")
    cached = Catalog.from_repository(repo).models["text_embedding"]
    assert (cached.text_entry, cached.max_batch_size) == ("text_embedding_cached", 64)

    catalog = Catalog.from_repository(repo, embedding_entry="direct")
    direct = catalog.models["text_embedding"]
    assert (direct.text_entry, direct.max_batch_size) == ("text_embedding", 32)
    assert direct.ids_entry == "text_encoder"
    assert catalog.triton_models(direct) == ("text_embedding", "text_encoder")


def test_without_the_cache_model_texts_go_to_the_ensemble(tmp_path):
    repo = _copy_configs(tmp_path / "repo")
    shutil.rmtree(repo / "text_embedding_cached")
    m = Catalog.from_repository(repo).models["text_embedding"]
    assert m.text_entry == "text_embedding"


def test_a_repository_without_the_generation_model_serves_embeddings_only(tmp_path):
    repo = _copy_configs(tmp_path / "repo")
    shutil.rmtree(repo / "text_generation")
    catalog = Catalog.from_repository(repo)
    assert set(catalog.models) == {"text_embedding", "text_reranker"}
    assert catalog.find("text_generation", "generation") is None


def test_a_broken_config_is_an_error_naming_its_file(tmp_path):
    repo = _copy_configs(tmp_path / "repo")
    (repo / "text_tokenizer" / "config.pbtxt").write_text('name: "text_tokenizer"\nmax_batch_size: [\n')
    with pytest.raises(CatalogError, match=r"text_tokenizer.config\.pbtxt: not a valid model configuration"):
        Catalog.from_repository(repo)
