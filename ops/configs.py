"""A model's configuration as files and as Triton's JSON form: which file Triton loads for a
model (``configs/<name>.pbtxt`` when a config name is chosen), and config.pbtxt text to and from
the JSON a load override sends (ops/repository.py, the rollout, the launcher's repository
preparation)."""

from __future__ import annotations

from pathlib import Path


def config_path(repository: Path, model: str, config_name: str | None) -> Path:
    """The config file Triton loads for ``model``: ``configs/<name>.pbtxt`` if present, else config.pbtxt."""
    folder = Path(repository) / model
    custom = folder / "configs" / f"{config_name}.pbtxt" if config_name else None
    return custom if custom is not None and custom.is_file() else folder / "config.pbtxt"


def config_from_disk(repository: Path, model: str, config_name: str | None) -> dict:
    """The config Triton would load for ``model`` (``configs/<name>.pbtxt`` if present), as JSON."""
    return config_from_text(config_path(repository, model, config_name).read_text(encoding="utf-8"), model)


def config_from_text(text: str, model: str) -> dict:
    """A config.pbtxt's text in Triton's JSON form (a load override), named ``model`` if it names none."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    message = text_format.Parse(text, model_config_pb2.ModelConfig())
    if not message.name:
        message.name = model
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def config_text(config: dict) -> str:
    """A config in Triton's JSON form as config.pbtxt text (e.g. the routed form of
    text_embedding for a repository that serves it side by side)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.MessageToString(json_format.ParseDict(config, model_config_pb2.ModelConfig()))
