from pathlib import Path

import pytest

from contract.errors import ConfigError
from contract.model_config import ModelConfig

CONFIG = {
    "name": "m",
    "max_batch_size": 64,
    "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": ["1"]}],
    "output": [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": ["384"]}],
    "parameters": {
        "n": {"string_value": "7"},
        "bad_int": {"string_value": "seven"},
        "flag": {"string_value": "TRUE"},
        "bad_flag": {"string_value": "maybe"},
        "buckets": {"string_value": "16, 32,64"},
        "session.intra_op.allow_spinning": {"string_value": "1"},
        "empty": {"string_value": ""},
    },
    "optimization": {
        "execution_accelerators": {"gpu_execution_accelerator": [{"name": "tensorrt", "parameters": {"precision_mode": "FP16"}}]},
        "graph": {"level": 1},
    },
}


def test_tensors_and_dims_are_typed():
    c = ModelConfig(CONFIG)
    assert c.max_batch_size == 64
    assert c.input("TEXT").dims == (1,)
    assert c.require("output", "EMBEDDING", "TYPE_FP32", (384,)).name == "EMBEDDING"


def test_require_names_the_mismatch():
    c = ModelConfig(CONFIG)
    with pytest.raises(ConfigError, match="must be TYPE_INT64, config says TYPE_FP32"):
        c.require("output", "EMBEDDING", "TYPE_INT64")
    with pytest.raises(ConfigError, match=r"must have dims \[768\]"):
        c.require("output", "EMBEDDING", "TYPE_FP32", (768,))
    with pytest.raises(ConfigError, match="no input named 'IDS'.*declared: TEXT"):
        c.input("IDS")


def test_parameters():
    c = ModelConfig(CONFIG)
    assert c.param_int("n", 1) == 7
    assert c.param_int("missing", 3) == 3
    assert c.param("empty", "dflt") == "dflt"
    assert c.param_bool("flag", False) is True
    assert c.param_int_list("buckets", []) == [16, 32, 64]
    assert c.params_with_prefix("session.") == {"session.intra_op.allow_spinning": "1"}
    with pytest.raises(ConfigError, match="'bad_int' must be an integer"):
        c.param_int("bad_int", 0)
    with pytest.raises(ConfigError, match="'bad_flag' must be a boolean"):
        c.param_bool("bad_flag", False)
    with pytest.raises(ConfigError, match="must be >= 10"):
        c.param_int("n", 0, minimum=10)


def test_accelerators_and_graph_level():
    c = ModelConfig(CONFIG)
    assert c.execution_accelerators("gpu") == [{"name": "tensorrt", "parameters": {"precision_mode": "FP16"}}]
    assert c.execution_accelerators("cpu") == []
    assert c.graph_optimization_level() == 1


def test_json_string_is_accepted():
    import json

    assert ModelConfig(json.dumps(CONFIG)).name == "m"


def test_every_ensemble_has_a_tracked_version_folder():
    """git keeps no empty folder: an ensemble's 1/ must hold a file (.gitkeep), or a fresh
    clone has no version and tritonserver refuses to start (it did, for text_embedding_interactive)."""
    import re as _re

    repo = Path(__file__).resolve().parents[2] / "model_repository"
    for config in repo.glob("*/config.pbtxt"):
        if _re.search(r'^platform:\s*"ensemble"', config.read_text(), _re.M):
            assert (config.parent / "1" / ".gitkeep").is_file(), f"{config.parent.name}/1/.gitkeep missing"


# A measured figure in a comment: a ratio ("1.4x", "0.6-0.8x") or a percentage ("12 %").
_FIGURE = r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?:x\b|\s?%)"


def test_config_comments_give_reasons_not_measurements():
    """A config comment says why in a line and links the page with the figures: figures in
    comments go stale (docs/performance.md and the subsystem pages keep them)."""
    import re as _re

    repo = Path(__file__).resolve().parents[2] / "model_repository"
    found = []
    for config in sorted(repo.glob("*/config.pbtxt")):
        for n, line in enumerate(config.read_text().splitlines(), 1):
            comment = line.partition("#")[2]
            if comment and _re.search(_FIGURE, comment):
                found.append(f"{config.parent.name}/config.pbtxt:{n}: {comment.strip()}")
    assert not found, "measurements in config comments (move them to docs/, link the page):\n" + "\n".join(found)
    assert _re.search(_FIGURE, "served 0.6-0.8x") and _re.search(_FIGURE, "cost 12 % of it")
    assert not _re.search(_FIGURE, "3 x 224 x 224 floats") and not _re.search(_FIGURE, "max 20 ms")
