"""What Triton serves, read from the repository as the server reads it: the encoder file, threads and
instances a PRECISION setting resolves to, a config's parameters, the tokenizer step, the input sentences.

The tools that measure a served model against the same model in-process (``perf.baselines.limit``,
``perf.bench.compare``, ``perf.bench.image_bench`` ...) take both sides from here, so they run the same files.
"""

from __future__ import annotations

import json
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


def served_config(repo: Path, model: str, config_name: str | None = None):
    """The config Triton loads for ``model`` under --model-config-name, parsed (contract.model_config.ModelConfig)."""
    from contract.model_config import ModelConfig
    from ops.configs import config_from_disk

    return ModelConfig(config_from_disk(repo, model, config_name))


def served_encoder(precision: str, repo: Path = REPOSITORY) -> ServedEncoder:
    """Resolve PRECISION as the server does (export.variants) to the encoder file and thread count."""
    config_name, served = resolve_precision(repo, [ENCODER], precision)
    variant = served[ENCODER]
    config = served_config(repo, ENCODER, config_name)
    # Triton's (and ONNX Runtime's) 0 = one thread per core; the same here.
    threads = config.param_int("intra_op_thread_count", 0) or bench.cpu_threads()
    return ServedEncoder(
        precision, config_name, variant, repo / ENCODER / "1" / VARIANTS[variant].filename, threads, config.instance_count()
    )


def load_sentences(path: Path = DEFAULT_INPUT) -> list[str]:
    """The texts of a perf_analyzer input-data JSON ({"data": [{"TEXT": {"content": [..]}}]})."""
    data = json.loads(Path(path).read_text())["data"]
    return [text for entry in data for text in entry["TEXT"]["content"]]


def served_tokenizer(repo: Path = REPOSITORY):
    """The tokenizer step's BatchTokenizer, configured from text_tokenizer/config.pbtxt."""
    from python_backends.text.tokenization import DEFAULT_BUCKETS, BatchTokenizer

    config = served_config(repo, TOKENIZER)
    buckets = config.param_int_list("sequence_buckets", DEFAULT_BUCKETS)
    file = config.param("tokenizer_file", "tokenizer.json")
    return BatchTokenizer(repo / TOKENIZER / "1" / file, config.param_int("max_sequence_length", 256), buckets)
