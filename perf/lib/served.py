"""What Triton serves, read from the repository as the server reads it: the encoder file, threads and
instances a PRECISION setting resolves to, a config's parameters, the tokenizer step, the input sentences.

The tools that measure a served model against the same model in-process (``perf.baselines.limit``,
``perf.bench.compare``, ``perf.bench.image_bench`` ...) take both sides from here, so they run the same files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from export import bench
from export.variants import VARIANTS, resolve_precision
from perf.lib.paths import REPOSITORY, SENTENCES_16TOK

DEFAULT_INPUT = SENTENCES_16TOK
ENCODER = "text_encoder"
TOKENIZER = "text_tokenizer"


@dataclass(frozen=True)
class ServedEncoder:
    """What Triton serves as the text encoder for one PRECISION setting."""

    precision: str  # the --precision asked for (cpu, fp32, ...)
    config_name: str | None  # tritonserver --model-config-name (None = config.pbtxt)
    variant: str  # fp32, int8, ...
    model_path: Path
    threads: int  # ONNX Runtime intra-op threads the served config gives each encoder instance
    instances: int = 1  # encoder instances (instance_group count) running at once

    @property
    def layout(self) -> str:
        return f"{self.instances}x{self.threads}"


def config_parameter(config_text: str, key: str) -> str | None:
    """The string_value of ``parameters { key: "<key>" ... }`` in a config.pbtxt text, or None.

    When a key appears twice (a generated variant config may append an override), the last
    one wins, as in Triton's parsed config (a protobuf map).
    """
    pattern = r'parameters\s*\{\s*key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"'
    found = re.findall(pattern, config_text)
    return found[-1] if found else None


def served_config_text(repo: Path, model: str, config_name: str | None) -> str:
    """The config.pbtxt Triton reads for ``model`` under --model-config-name=config_name."""
    variant = repo / model / "configs" / f"{config_name}.pbtxt" if config_name else None
    return (variant if variant is not None and variant.is_file() else repo / model / "config.pbtxt").read_text()


def served_config(repo: Path, model: str, config_name: str | None = None):
    """The config Triton loads for ``model`` under --model-config-name, parsed (contract.model_config.ModelConfig)."""
    from contract.model_config import ModelConfig
    from ops.configs import config_from_text

    return ModelConfig(config_from_text(served_config_text(repo, model, config_name), model))


def served_encoder(precision: str, repo: Path = REPOSITORY) -> ServedEncoder:
    """Resolve PRECISION as the server does (export.variants) to the encoder file and thread count."""
    config_name, served = resolve_precision(repo, [ENCODER], precision)
    variant = served[ENCODER]
    text = served_config_text(repo, ENCODER, config_name)
    # Triton's (and ONNX Runtime's) 0 = one thread per core; the same here.
    threads = int(config_parameter(text, "intra_op_thread_count") or 0) or bench.cpu_threads()
    return ServedEncoder(
        precision, config_name, variant, repo / ENCODER / "1" / VARIANTS[variant].filename, threads, instance_count(text)
    )


def instance_count(config_text: str) -> int:
    """Instances of a config.pbtxt text: the sum of its instance_group counts (1 when unset)."""
    groups = re.findall(r"instance_group\s*\[(.*?)\]", config_text, flags=re.DOTALL)
    counts = [int(c) for g in groups for c in re.findall(r"count:\s*(\d+)", _strip_comments(g))]
    return sum(counts) or 1


def _strip_comments(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def load_sentences(path: Path = DEFAULT_INPUT) -> list[str]:
    """The texts of a perf_analyzer input-data JSON ({"data": [{"TEXT": {"content": [..]}}]})."""
    data = json.loads(Path(path).read_text())["data"]
    return [text for entry in data for text in entry["TEXT"]["content"]]


def served_tokenizer(repo: Path = REPOSITORY):
    """The tokenizer step's BatchTokenizer, configured from text_tokenizer/config.pbtxt."""
    from python_backends.text.tokenization import DEFAULT_BUCKETS, BatchTokenizer

    text = (repo / TOKENIZER / "config.pbtxt").read_text()
    file = config_parameter(text, "tokenizer_file") or "tokenizer.json"
    max_length = int(config_parameter(text, "max_sequence_length") or 256)
    buckets_text = config_parameter(text, "sequence_buckets")
    buckets = [int(b) for b in buckets_text.split(",")] if buckets_text else list(DEFAULT_BUCKETS)
    return BatchTokenizer(repo / TOKENIZER / "1" / file, max_length, buckets)
