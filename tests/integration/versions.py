"""Model repositories with several text_encoder versions for the rollout tests: a copy of the
project's repository (the exported ONNX files linked, not copied) where version 2 is the INT8
model with its output negated (a unit vector like version 1's, told apart by its sign, so an
answer of the wrong version is seen) and version 3 (optional) the INT8 model behind a truncated
vocabulary: a Gather over a 5,000-row table in front of the output, so it loads, passes its
warmup and a smoke check of common word pieces, and fails every request holding a rarer one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from server.layout import ROOT

VOCAB_LIMIT = 5000


def copy_repository(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name == "__pycache__":
            continue
        if p.is_dir():
            copy_repository(p, dst / p.name)
        elif p.suffix == ".onnx":
            os.symlink(p.resolve(), dst / p.name)
        else:
            shutil.copy2(p, dst / p.name)


def _rewired(src: Path, dst: Path, nodes, initializers=()) -> None:
    """The model with its output renamed <out>_raw and ``nodes`` computing <out> from it."""
    import onnx

    model = onnx.load(str(src))
    graph = model.graph
    out = graph.output[0].name
    for node in graph.node:
        node.output[:] = [o + "_raw" if o == out else o for o in node.output]
    graph.initializer.extend(initializers)
    graph.node.extend(nodes(out))
    onnx.save(model, str(dst))


def _negated(src: Path, dst: Path) -> None:
    from onnx import helper

    _rewired(src, dst, lambda out: [helper.make_node("Neg", [out + "_raw"], [out])])


def _truncated_vocabulary(src: Path, dst: Path) -> None:
    from onnx import helper, numpy_helper

    _rewired(
        src,
        dst,
        lambda out: [
            helper.make_node("Gather", ["truncated_vocab", "input_ids"], ["vocab_rows"]),  # fails for ids >= 5000
            helper.make_node("ReduceSum", ["vocab_rows"], ["vocab_zero"], keepdims=0),
            helper.make_node("Add", [out + "_raw", "vocab_zero"], [out]),
        ],
        [numpy_helper.from_array(np.zeros((VOCAB_LIMIT, 1), np.float32), "truncated_vocab")],
    )


def versioned_repository(dst: Path, broken_version: bool = False) -> Path:
    """A copy of the project's model repository at ``dst`` with text_encoder versions 2 (and 3)."""
    copy_repository(ROOT / "model_repository", dst)
    encoder = dst / "text_encoder"
    versions = ("2", "3") if broken_version else ("2",)
    for version in versions:
        (encoder / version).mkdir()
        for p in (encoder / "1").iterdir():
            if p.name != "model.int8.onnx":
                os.symlink(p.resolve(), encoder / version / p.name)
    _negated(encoder / "1" / "model.int8.onnx", encoder / "2" / "model.int8.onnx")
    if broken_version:
        _truncated_vocabulary(encoder / "1" / "model.int8.onnx", encoder / "3" / "model.int8.onnx")
    return dst
