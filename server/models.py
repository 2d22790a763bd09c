"""Which models a server loads: the defaults, what a request to a model reaches, the load order.

Read from the repository's config.pbtxt files (ensemble steps, the ``load_with`` parameter of a
BLS model), so that the launcher, serve-cluster and the tests agree on one model set.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

# text_embedding_cached: the cached entry point in front of text_embedding (docs/result-cache.md).
# text_generation: the LLM (docs/export.md); its weights are exported by `python -m export`.
DEFAULT_MODELS = (
    "text_embedding",
    "text_embedding_cached",
    "text_embedding_cached_interactive",
    "text_embedding_cached_bulk",
    "image_classification",
    "text_generation",
)
# Default models a repository may lack: left out of the default set when their folder has no
# config.pbtxt (a repository made before the generation model, or one holding only the
# embedding and image models). Asked for by name (--model), they load or fail as any other.
OPTIONAL_DEFAULT_MODELS = ("text_generation",)


def default_models(repository: Path) -> tuple[str, ...]:
    """The models `python -m server` loads when none are named."""
    return tuple(
        m for m in DEFAULT_MODELS if m not in OPTIONAL_DEFAULT_MODELS or (Path(repository) / m / "config.pbtxt").is_file()
    )


def _config_text(repository: Path, model: str) -> str:
    path = Path(repository) / model / "config.pbtxt"
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def references(repository: Path, model: str) -> tuple[list[str], list[str]]:
    """(ensemble steps, ``load_with`` targets) named in a model's config.pbtxt."""
    text = _config_text(repository, model)
    steps = re.findall(r'model_name:\s*"([^"]+)"', text)
    m = re.search(r'key:\s*"load_with"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    return steps, [t.strip() for t in (m.group(1).split(",") if m else []) if t.strip()]


def closure(repository: Path, model: str) -> list[str]:
    """Every model a request to ``model`` may reach through ensemble steps and ``load_with``."""
    out: list[str] = []
    todo = [model]
    while todo:
        current = todo.pop()
        if current in out:
            continue
        out.append(current)
        steps, targets = references(repository, current)
        todo += steps + targets
    return out


def with_dependencies(repository: Path, models: Sequence[str]) -> list[str]:
    """``models`` plus what Triton does not load for them: the ``load_with`` targets of a BLS
    model (text_encoder_router names text_encoder), also when it is an ensemble's step. The
    targets come first."""
    out: list[str] = []
    for model in models:
        for reached in closure(repository, model):
            for target in references(repository, reached)[1]:
                if target not in out:
                    out.append(target)
    return out + [m for m in models if m not in out]


def variant_models(repository: Path, models: Sequence[str]) -> list[str]:
    """The models a request can reach (ensemble steps, BLS ``load_with`` targets) that have
    precision variants (a ``variants.json``, export/variants.py)."""
    repository = Path(repository)
    found = []
    for model in models:
        for name in closure(repository, model):
            if (repository / name / "variants.json").is_file() and name not in found:
                found.append(name)
    return found


def openai_models(repository: Path, models: Sequence[str]) -> list[str]:
    """The OpenAI model ids the gateway can serve with ``models`` loaded (none: no gateway)."""
    from openai_gateway.catalog import Catalog

    loaded = {name for model in models for name in closure(repository, model)}
    catalog = Catalog.from_repository(repository)
    return [m.id for m in catalog.models.values() if set(catalog.triton_models(m)) <= loaded]
