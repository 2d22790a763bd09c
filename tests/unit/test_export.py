"""Export of the text encoder: parity gate against PyTorch, idempotence, failure path."""

import json

import numpy as np
import pytest

from export import text_encoder


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    return repo, text_encoder.export(repo)


def test_export_writes_model_tokenizer_and_manifest(exported):
    repo, result = exported
    assert not result.skipped
    assert result.max_abs_diff is not None and result.max_abs_diff <= text_encoder.MAX_ABS_DIFF
    assert (repo / "text_tokenizer" / "1" / "tokenizer.json").is_file()
    manifest = json.loads((repo / "text_encoder" / "1" / "model.export.json").read_text())
    assert manifest["max_abs_diff"] == result.max_abs_diff
    assert manifest["source"] == text_encoder.source_fingerprint()


def test_exported_graph_has_named_dynamic_axes(exported):
    import onnx

    repo, _ = exported
    model = onnx.load(str(repo / "text_encoder" / "1" / "model.onnx"), load_external_data=False)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    assert inputs == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
    assert outputs == {"sentence_embedding": ["batch", 384]}


def test_second_export_is_skipped_and_force_redoes(exported, monkeypatch):
    repo, _ = exported
    assert text_encoder.up_to_date(repo)
    assert text_encoder.export(repo).skipped
    # a changed model file is no longer up to date
    model = repo / "text_encoder" / "1" / "model.onnx"
    original = model.read_bytes()
    model.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    assert not text_encoder.up_to_date(repo)
    model.write_bytes(original)
    assert text_encoder.up_to_date(repo)


def test_gate_rejects_an_export_that_misses_its_tolerance(tmp_path, monkeypatch):
    monkeypatch.setattr(text_encoder, "MAX_ABS_DIFF", 0.0)  # nothing real passes a zero tolerance
    with pytest.raises(RuntimeError, match="export rejected"):
        text_encoder.export(tmp_path)
    assert not (tmp_path / "text_encoder" / "1" / "model.onnx").exists()
    assert not text_encoder.up_to_date(tmp_path)


def test_parity_check_measures_a_real_difference(exported, tmp_path):
    """A corrupted graph must show a large difference (the check cannot pass vacuously)."""
    import onnx
    from onnx import numpy_helper

    repo, _ = exported
    model = onnx.load(str(repo / "text_encoder" / "1" / "model.onnx"))
    init = max(model.graph.initializer, key=lambda t: np.prod(t.dims))  # the largest weight
    array = numpy_helper.to_array(init).copy()
    array *= 1.5
    init.CopyFrom(numpy_helper.from_array(array, init.name))
    broken = tmp_path / "broken.onnx"
    onnx.save(model, str(broken))
    assert text_encoder.check_parity(broken, ["A short sentence.", "Another one, a bit longer than the first."]) > 1e-2
