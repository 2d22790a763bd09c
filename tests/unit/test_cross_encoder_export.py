"""Export of a user's cross-encoder checkpoint (text_cross_encoder): a random-init
BertForSequenceClassification (1 label) saved as a checkpoint folder, exported, gated, installed;
a deliberately broken graph fails its gate and installs nothing; other architectures are refused."""

import copy
import json
import shutil

import numpy as np
import onnx
import pytest
import torch

from contract.errors import InputError
from export import __main__ as export_cli
from export import cross_encoder, pipeline, variants
from python_backends.text.pairs import PairTokenizer
from server.layout import ROOT
from tests.unit.cross_encoder_checkpoint import make_checkpoint

FOLDERS = ("text_pair_tokenizer", "text_cross_encoder")


def _repo(tmp_path):
    repo = tmp_path / "model_repository"
    for name in FOLDERS:
        shutil.copytree(
            ROOT / "model_repository" / name,
            repo / name,
            ignore=shutil.ignore_patterns("__pycache__", "*.json", "*.onnx", "configs"),
        )
    return repo


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "my-cross-encoder")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, checkpoint):
    repo = _repo(tmp_path_factory.mktemp("repo"))
    return repo, cross_encoder.export(repo, checkpoint)


def test_export_passes_its_gate_and_installs_model_tokenizer_and_manifest(exported, checkpoint):
    repo, result = exported
    gate = variants.load_gates()["text_cross_encoder"]["fp32"]
    assert not result.skipped and variants.check_gate(result.metrics, gate) == []
    assert result.metrics["pairs"] == sum(len(d) for _, d in cross_encoder.gate_pairs())
    assert result.metrics["ranked_document_pairs"] > 20 and result.metrics["logit_spread"] > 0.01
    model_path, tok_path = cross_encoder.paths(repo)
    assert tok_path.read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
    manifest = json.loads(model_path.with_suffix(".export.json").read_text())
    assert manifest["source"] == cross_encoder.source_fingerprint(checkpoint)
    assert manifest["source"]["weights_file"] == "model.safetensors"
    assert manifest["source"]["builder_version"] == cross_encoder.BUILDER_VERSION
    assert manifest["metrics"] == result.metrics and manifest["gate"] == gate
    assert not list((repo / "text_cross_encoder" / "1").glob(".staging-*"))


def test_graph_takes_pairs_with_dynamic_batch_and_sequence(exported):
    repo, _ = exported
    model = onnx.load(str(cross_encoder.paths(repo)[0]))
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
    assert {i.name: dims(i) for i in model.graph.input} == {
        n: ["batch", "sequence"] for n in ("input_ids", "attention_mask", "token_type_ids")
    }
    assert {o.name: dims(o) for o in model.graph.output} == {"logits": ["batch", 1]}


def test_second_export_is_skipped_until_the_checkpoint_changes(exported, checkpoint, tmp_path):
    repo, _ = exported
    assert cross_encoder.export(repo, checkpoint).skipped
    other = make_checkpoint(tmp_path / "other", seed=1)
    assert (
        cross_encoder.source_fingerprint(other)["weights_sha256"]
        != cross_encoder.source_fingerprint(checkpoint)["weights_sha256"]
    )


def test_a_broken_graph_fails_the_gate(exported, checkpoint, tmp_path):
    """The same checkpoint exported with its segment embeddings zeroed: the graph ignores which
    tokens are the document, as a wrong export of token_type_ids would."""
    repo, _ = exported
    model = cross_encoder.load_torch_model(checkpoint.resolve())
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.bert.embeddings.token_type_embeddings.weight.zero_()
    cross_encoder.export_onnx(broken, tmp_path / "broken.onnx")
    tokenizer = cross_encoder.pair_tokenizer(cross_encoder.paths(repo)[1], repo)
    metrics = cross_encoder.evaluate(cross_encoder.onnx_runner(tmp_path / "broken.onnx"), model, tokenizer)
    gate = variants.load_gates()["text_cross_encoder"]["fp32"]
    assert any(f.startswith("logit_diff") for f in variants.check_gate(metrics, gate)), metrics
    # And the right graph fed no padding mask (every position attended to).
    run = cross_encoder.onnx_runner(cross_encoder.paths(repo)[0])
    unmasked = cross_encoder.evaluate(lambda f: run({**f, "attention_mask": np.ones_like(f["attention_mask"])}), model, tokenizer)
    assert any(f.startswith("logit_diff") for f in variants.check_gate(unmasked, gate)), unmasked
    print(f"segment ids dropped: {metrics}; padding mask dropped: {unmasked}")


def test_a_gate_failure_installs_nothing_and_keeps_the_served_model(exported, checkpoint, tmp_path, monkeypatch):
    repo, _ = exported
    model_path, tok_path = cross_encoder.paths(repo)
    before = model_path.read_bytes(), model_path.with_suffix(".export.json").read_bytes()
    real = cross_encoder.export_onnx

    def drop_segments(model, path, properties=None):
        broken = copy.deepcopy(model)
        with torch.no_grad():
            broken.bert.embeddings.token_type_embeddings.weight.zero_()
        real(broken, path, properties)

    monkeypatch.setattr(cross_encoder, "export_onnx", drop_segments)
    with pytest.raises(cross_encoder.GateFailed, match="GATE FAILED.*logit_diff.*nothing installed"):
        cross_encoder.export(repo, checkpoint, force=True)
    assert (model_path.read_bytes(), model_path.with_suffix(".export.json").read_bytes()) == before
    assert not list(model_path.parent.glob(".staging-*"))


@pytest.mark.parametrize(
    "change, found",
    [
        ({"architectures": ["BertModel"]}, "architectures ['BertModel']"),
        ({"model_type": "roberta", "architectures": ["RobertaForSequenceClassification"]}, "model_type 'roberta'"),
        ({"id2label": {"0": "no", "1": "yes"}, "label2id": {"no": 0, "yes": 1}}, "2 label(s)"),
    ],
)
def test_other_architectures_are_refused_naming_what_was_found(checkpoint, tmp_path, change, found):
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    config.update(change)
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(cross_encoder.CheckpointError, match="not a BERT cross-encoder") as info:
        cross_encoder.export(_repo(tmp_path), other)
    assert found in str(info.value)
    assert not cross_encoder.paths(tmp_path / "model_repository")[0].exists()


def test_a_checkpoint_with_fewer_positions_than_the_served_length_is_refused(tmp_path):
    short = make_checkpoint(tmp_path / "short", max_position_embeddings=128)
    with pytest.raises(cross_encoder.CheckpointError, match="max_position_embeddings is 128.*max_sequence_length 512"):
        cross_encoder.export(_repo(tmp_path), short)


def test_the_pipeline_records_the_gate_in_variants_json(exported, checkpoint):
    repo, _ = exported
    report = pipeline.run(cross_encoder.TextCrossEncoderPipeline(checkpoint), repo, speed=False)
    (row,) = report["variants"]
    assert row["variant"] == "fp32" and row["status"] == "passed", row
    entry = variants.read_manifest(repo, "text_cross_encoder")["variants"]["fp32"]
    assert entry["builder_version"] == cross_encoder.BUILDER_VERSION and entry["file_sha256"]
    assert (repo / "text_cross_encoder" / "configs" / "cpu.pbtxt").is_file()


def test_cli_needs_weights_and_never_exports_the_reranker_by_default(capsys):
    with pytest.raises(SystemExit):
        export_cli.main(["--model", "text_cross_encoder"])
    assert "--weights" in capsys.readouterr().err
    assert "text_cross_encoder" in export_cli.ON_REQUEST and "text_cross_encoder" in export_cli.TAKES_WEIGHTS


# ---- the pair tokenizer (python_backends/text/pairs.py) ------------------------------------


@pytest.fixture(scope="module")
def pairs(checkpoint):
    return PairTokenizer(checkpoint / "tokenizer.json", max_length=64, buckets=(16, 32, 64))


def test_pairs_have_segments_and_bucketed_padding(pairs):
    out = pairs.encode("what is rust", ["a language", "a reddish-brown iron oxide that forms on metal"])
    assert out.input_ids.shape == out.token_type_ids.shape == out.attention_mask.shape == (2, 16)
    row = out.token_type_ids[0][out.attention_mask[0] == 1]
    assert row[0] == 0 and row[-1] == 1 and 0 < row.sum() < row.size  # [CLS] q [SEP] | d [SEP]
    assert list(out.num_tokens) == list(out.attention_mask.sum(axis=1))


def test_a_pair_over_the_limit_is_refused_naming_the_document(pairs):
    with pytest.raises(InputError) as info:
        pairs.encode("q", ["short", "word " * 100])
    assert info.value.field == "DOCUMENTS[1]" and info.value.values["limit"] == 64 and info.value.values["tokens"] > 64


def test_document_truncation_keeps_the_query_and_the_closing_separator(checkpoint):
    cut = PairTokenizer(checkpoint / "tokenizer.json", max_length=32, buckets=(16, 32), truncation="document")
    out = cut.encode("the query", ["word " * 100])
    assert out.input_ids.shape == (1, 32) and out.num_tokens[0] > 100
    assert out.input_ids[0, -1] == 102 and out.token_type_ids[0, -1] == 1  # [SEP]
    with pytest.raises(InputError) as info:
        cut.encode("long query " * 40, ["d"])
    assert info.value.field == "QUERY"


def test_a_documents_score_does_not_depend_on_the_padding_beside_it(exported, checkpoint):
    """A document scores the same alone and padded beside a long one (the mask is in the graph)."""
    repo, _ = exported
    tokenizer = cross_encoder.pair_tokenizer(cross_encoder.paths(repo)[1], repo)
    run = cross_encoder.onnx_runner(cross_encoder.paths(repo)[0])

    def score(docs):
        p = tokenizer.encode("query", docs)
        return np.asarray(run({"input_ids": p.input_ids, "attention_mask": p.attention_mask, "token_type_ids": p.token_type_ids}))

    alone = score(["a short document"])[0, 0]
    padded = score(["a short document", "a much longer document " * 20])[0, 0]
    assert abs(alone - padded) < 1e-4
