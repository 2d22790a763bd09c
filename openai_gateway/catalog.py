"""The models the gateway serves, and their limits, read from the model repository.

An OpenAI model id is a Triton model name (``text_embedding``, ``text_generation``); the
Hugging Face name of the weights each serves is accepted as an alias. Everything else comes
from config.pbtxt: the embedding ensemble's steps name the tokenizer (its file, its
``max_sequence_length``, its buckets) and the encoder step that token arrays go to; the
result cache entry point is the Python model whose ``target_model`` is the ensemble; the
generation model's ``parameters`` give its token limits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

from contract.kserve import CONFIG_DATATYPES
from contract.model_config import ModelConfig
from contract.streams import continuable

# The weights each model serves (export/): the names applications already use for them.
ALIASES = {
    "text_embedding": ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2"),
    "text_generation": ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
}
OWNER = "triton-model-repository"


class CatalogError(RuntimeError):
    """A model repository the gateway cannot serve from (a config it cannot read)."""


def read_config(path: Path) -> ModelConfig:
    """A config.pbtxt parsed with Triton's own protobuf schema."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    message = text_format.Parse(path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
    return ModelConfig(json_format.MessageToDict(message, preserving_proto_field_name=True))


@dataclass(frozen=True)
class EmbeddingModel:
    """An embedding ensemble as the gateway serves it: its entry models, limits and tokenizer."""

    id: str  # the ensemble, TEXT -> EMBEDDING
    text_entry: str  # the Triton model texts are sent to (the cache entry point by default)
    ids_entry: str  # the model token arrays go to (input_ids, attention_mask -> sentence_embedding)
    ids_output: str
    max_batch_size: int  # of text_entry; larger requests are split
    ids_max_batch_size: int
    tokenizer_file: Path
    max_tokens: int  # the tokenizer's max_sequence_length
    buckets: tuple[int, ...]
    dimensions: int
    aliases: tuple[str, ...] = ()
    kind: str = "embedding"
    created: int = 0  # Unix time its newest version folder was written (the export)
    # (priority class, text entry, ids entry) of each class with its own entry
    # (docs/priority-classes.md); a class not listed is served by text_entry / ids_entry.
    lanes: tuple[tuple[str, str, str], ...] = ()

    def entries(self, priority_class: str | None) -> tuple[str, str]:
        """(text entry, ids entry) serving ``priority_class`` (None: the default class)."""
        for cls, text, ids in self.lanes:
            if cls == priority_class:
                return text, ids
        return self.text_entry, self.ids_entry


@dataclass(frozen=True)
class GenerationModel:
    """The generation model and its context length (config.pbtxt ``parameters``); its other
    limits are the model's own to check (errors come back as data)."""

    id: str
    max_model_len: int
    aliases: tuple[str, ...] = ()
    kind: str = "generation"
    created: int = 0
    version_dir: Path | None = None  # its tokenizer and chat template (/tokenize)
    # Its config declares return_token_ids and prefix_token_ids: a stream lost mid-answer is continued.
    continuable: bool = False


@dataclass(frozen=True)
class RerankerModel:
    """A cross-encoder ensemble (QUERY [1], DOCUMENTS [n] -> SCORES [n, 1], NUM_TOKENS [n]); its
    limits are its pair tokenizer step's parameters, which that step enforces itself."""

    id: str
    steps: tuple[str, ...]  # the pair tokenizer and the encoder
    max_documents: int  # per Triton request; a request with more is sent in several
    max_tokens: int  # per (query, document) pair
    truncation: str  # the pair tokenizer's: "refuse" a long pair, or cut its "document"
    aliases: tuple[str, ...] = ()
    kind: str = "reranker"
    created: int = 0


Model = EmbeddingModel | GenerationModel | RerankerModel


def _configs(repository: Path) -> dict[str, ModelConfig]:
    found = {}
    for path in sorted(Path(repository).glob("*/config.pbtxt")):
        try:
            config = read_config(path)
        except Exception as exc:  # a model Triton cannot load either; the others still serve
            raise CatalogError(f"{path}: not a valid model configuration: {exc}") from exc
        found[config.name or path.parent.name] = config
    return found


def _embedding(
    name: str, config: ModelConfig, configs: dict[str, ModelConfig], repository: Path, entry: str
) -> EmbeddingModel | None:
    steps = [s.get("model_name") for s in config.raw.get("ensemble_scheduling", {}).get("step", [])]
    if len(steps) != 2 or steps[0] not in configs or steps[1] not in configs:
        return None
    tokenizer, encoder = configs[steps[0]], configs[steps[1]]
    if tokenizer.param("tokenizer_file") is None:
        return None
    out = next((o for o in config.outputs if o.name == "EMBEDDING"), None)
    if out is None or not any(i.name == "TEXT" for i in config.inputs):
        return None
    # The priority classes' entries: cached entries (priority_class parameter, default "default")
    # whose target is this ensemble or one of its lanes (an ensemble whose lane_of names it).
    targets = {name: steps[1]}
    for n, c in configs.items():
        lane_steps = [s.get("model_name") for s in c.raw.get("ensemble_scheduling", {}).get("step", [])]
        if c.param("lane_of") == name and len(lane_steps) == 2:
            targets[n] = lane_steps[1]
    by_class: dict[str, tuple[str, str]] = {}
    for n, c in sorted(configs.items()):
        target = c.param("target_model")
        if target in targets and c.max_batch_size > 0:
            by_class.setdefault(c.param("priority_class", "default"), (n if entry == "cached" else target, targets[target]))
    for n, c in configs.items():  # a lane without a cached entry is still its class's direct entry
        if n in targets and n != name:
            by_class.setdefault(c.param("priority_class", "default"), (n, targets[n]))
    text_entry = by_class.get("default", (name,))[0] if entry == "cached" else name
    encoder_out = next((o.name for o in encoder.outputs if o.data_type == "TYPE_FP32"), "sentence_embedding")
    version = repository / steps[0] / "1"
    max_tokens = tokenizer.param_int("max_sequence_length", 256, minimum=1)
    return EmbeddingModel(
        id=name,
        text_entry=text_entry,
        ids_entry=steps[1],
        ids_output=encoder_out,
        max_batch_size=max(1, configs[text_entry].max_batch_size),
        ids_max_batch_size=max(1, encoder.max_batch_size),
        tokenizer_file=version / (tokenizer.param("tokenizer_file") or "tokenizer.json"),
        max_tokens=max_tokens,
        buckets=tuple(sorted(set(tokenizer.param_int_list("sequence_buckets", [max_tokens])))),
        dimensions=int(out.dims[0]) if out.dims else 0,
        aliases=ALIASES.get(name, ()),
        lanes=tuple((cls, text, ids) for cls, (text, ids) in sorted(by_class.items())),
    )


def _reranker(name: str, config: ModelConfig, configs: dict[str, ModelConfig]) -> RerankerModel | None:
    steps = [s.get("model_name") for s in config.raw.get("ensemble_scheduling", {}).get("step", [])]
    if len(steps) != 2 or steps[0] not in configs or steps[1] not in configs:
        return None
    if {i.name for i in config.inputs} != {"QUERY", "DOCUMENTS"} or not {"SCORES", "NUM_TOKENS"} <= {
        o.name for o in config.outputs
    }:
        return None
    tokenizer = configs[steps[0]]
    return RerankerModel(
        id=name,
        steps=(steps[0], steps[1]),
        max_documents=tokenizer.param_int("max_documents", 64, minimum=1),
        max_tokens=tokenizer.param_int("max_sequence_length", 512, minimum=1),
        truncation=tokenizer.param("truncation", "refuse"),
        aliases=ALIASES.get(name, ()),
    )


def _generation(name: str, config: ModelConfig, repository: Path) -> GenerationModel | None:
    decoupled = bool(config.raw.get("model_transaction_policy", {}).get("decoupled"))
    names = {i.name for i in config.inputs}
    if not decoupled or not {"text_input", "sampling_parameters"} <= names:
        return None
    return GenerationModel(
        id=name,
        max_model_len=config.param_int("max_model_len", 4096, minimum=1),
        aliases=ALIASES.get(name, ()),
        version_dir=repository / name / "1",
        continuable=continuable(decoupled, {i.name: CONFIG_DATATYPES.get(i.data_type, "") for i in config.inputs}),
    )


class Catalog:
    """The OpenAI-servable models of a repository, by id and alias."""

    def __init__(self, models: list[Model]):
        self.models = {m.id: m for m in models}
        self._names: dict[str, Model] = {}
        for m in models:
            self._names[m.id] = m
            for alias in m.aliases:
                self._names.setdefault(alias, m)

    @classmethod
    def from_repository(cls, repository: Path, embedding_entry: str = "cached") -> Catalog:
        """The catalog of the model repository at ``repository`` (lanes are not models of their own)."""
        configs = _configs(repository)
        models: list[Model] = []
        for name, config in configs.items():
            if config.param("lane_of"):  # a priority class's lane of another model, not a model of its own
                continue
            m: Model | None
            if config.raw.get("platform") == "ensemble":
                m = _embedding(name, config, configs, Path(repository), embedding_entry) or _reranker(name, config, configs)
            else:
                m = _generation(name, config, Path(repository))
            if m is not None:
                models.append(dataclasses.replace(m, created=_created(Path(repository), _triton_models(m))))
        return cls(models)

    @overload
    def find(self, name: object, kind: Literal["embedding"]) -> EmbeddingModel | None: ...

    @overload
    def find(self, name: object, kind: Literal["generation"]) -> GenerationModel | None: ...

    @overload
    def find(self, name: object, kind: Literal["reranker"]) -> RerankerModel | None: ...

    @overload
    def find(self, name: object, kind: str) -> Model | None: ...

    def find(self, name: object, kind: str) -> Model | None:
        """The model of ``kind`` named ``name`` (id or alias); None when there is none."""
        model = self._names.get(name) if isinstance(name, str) else None
        return model if model is not None and model.kind == kind else None

    @overload
    def of_kind(self, kind: Literal["embedding"]) -> list[EmbeddingModel]: ...

    @overload
    def of_kind(self, kind: Literal["generation"]) -> list[GenerationModel]: ...

    @overload
    def of_kind(self, kind: Literal["reranker"]) -> list[RerankerModel]: ...

    @overload
    def of_kind(self, kind: str) -> list[Model]: ...

    def of_kind(self, kind: str) -> list[Any]:
        """The models of ``kind`` (``embedding``, ``generation`` or ``reranker``)."""
        return [m for m in self.models.values() if m.kind == kind]

    def triton_models(self, model: Model) -> tuple[str, ...]:
        """The Triton models a request to ``model`` reaches (all must be ready to serve it)."""
        return _triton_models(model)


def _triton_models(model: Model) -> tuple[str, ...]:
    if isinstance(model, EmbeddingModel):
        return tuple(dict.fromkeys((model.text_entry, model.id, model.ids_entry)))
    if isinstance(model, RerankerModel):
        return (model.id, *model.steps)
    return (model.id,)


def _created(repository: Path, names: tuple[str, ...]) -> int:
    """When the newest version folder of the Triton models behind a served model was written."""
    times = [p.stat().st_mtime for n in names for p in (repository / n).glob("[0-9]*") if p.is_dir()]
    return int(max(times)) if times else 0
