"""Export a user's BERT cross-encoder checkpoint for ``text_reranker`` (on request, never by default).

``python -m export --model text_cross_encoder --weights <checkpoint dir>``: a Hugging Face
folder holding a ``BertForSequenceClassification`` with ONE label (an ms-marco MiniLM
cross-encoder's layout: config.json, model.safetensors or pytorch_model.bin, tokenizer.json or
vocab.txt). Anything else is refused before any work, naming what was found.

The ONNX graph takes the pair rows of ``text_pair_tokenizer`` (input_ids, attention_mask,
token_type_ids [batch, sequence], both axes dynamic) and returns the classifier's raw logit
(``logits`` [batch, 1]), opset 17, FP32. It is built in a staging folder and gated there: ONNX
Runtime against transformers' own forward of the same checkpoint on export/data/rerank_pairs.json
(each query's documents padded together, as served), max abs logit difference and the
documents' order per query, limits in export/gates.toml ``[text_cross_encoder.fp32]``. Only an
export that passes is installed (model.onnx, the tokenizer beside text_pair_tokenizer, a manifest
with the checkpoint's hashes and the builder version); a failure leaves what was served before.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from export import variants
from python_backends.files import sha256_file

log = logging.getLogger(__name__)

NAME = "text_cross_encoder"
TOKENIZER_STEP = "text_pair_tokenizer"
OPSET = 17
BUILDER_VERSION = 1  # bump when the export changes what it writes
HERE = Path(__file__).resolve().parent
PAIRS = HERE / "data" / "rerank_pairs.json"
ARCHITECTURE = "BertForSequenceClassification"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_REPEAT = re.compile(r"^\{\{REPEAT:(?P<text>.*):(?P<n>\d+)\}\}$", re.S)


class CheckpointError(ValueError):
    """The checkpoint is not one this export takes (architecture, labels, files)."""


class GateFailed(RuntimeError):
    """The exported graph missed its gate; nothing was installed."""


@dataclass
class ExportResult:
    model_path: Path
    skipped: bool
    metrics: dict[str, Any] | None
    seconds: float


def gate_pairs() -> list[tuple[str, list[str]]]:
    """(query, documents) of export/data/rerank_pairs.json, ``{{REPEAT:text:N}}`` expanded."""
    out = []
    for item in json.loads(PAIRS.read_text(encoding="utf-8"))["queries"]:
        docs = []
        for doc in item["documents"]:
            m = _REPEAT.match(doc)
            docs.append(m["text"] * int(m["n"]) if m else doc)
        out.append((item["query"], docs))
    return out


# ---- the checkpoint ---------------------------------------------------------------------


def check_checkpoint(weights: Path) -> dict[str, Any]:
    """config.json of a BERT sequence-classification checkpoint with one label, else CheckpointError."""
    weights = Path(weights)
    config_path = weights / "config.json"
    if not weights.is_dir() or not config_path.is_file():
        raise CheckpointError(f"{weights}: expected a checkpoint folder with config.json (a Hugging Face save_pretrained folder)")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    num_labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 2)
    if model_type != "bert" or architectures != [ARCHITECTURE] or num_labels != 1:
        raise CheckpointError(
            f"{weights}: not a BERT cross-encoder: expected model_type 'bert', architectures ['{ARCHITECTURE}'] and "
            f"1 label; found model_type {model_type!r}, architectures {architectures}, {num_labels} label(s)"
        )
    if weights_file(weights) is None:
        raise CheckpointError(f"{weights}: no weights file ({' or '.join(WEIGHT_FILES)})")
    if not (weights / "tokenizer.json").is_file() and not (weights / "vocab.txt").is_file():
        raise CheckpointError(f"{weights}: no tokenizer (tokenizer.json or vocab.txt)")
    return config


def weights_file(weights: Path) -> Path | None:
    return next((weights / f for f in WEIGHT_FILES if (weights / f).is_file()), None)


def source_fingerprint(weights: Path) -> dict[str, Any]:
    """What the export is built from: the checkpoint's files, the gate pairs, this code."""
    weights = Path(weights)
    wfile = weights_file(weights)
    tok = weights / "tokenizer.json"
    return {
        "weights_file": wfile.name if wfile else None,
        "weights_sha256": sha256_file(wfile) if wfile else None,
        "config_sha256": sha256_file(weights / "config.json"),
        "tokenizer_sha256": sha256_file(tok if tok.is_file() else weights / "vocab.txt"),
        "pairs_sha256": sha256_file(PAIRS),
        "code_sha256": sha256_file(Path(__file__)),
        "opset": OPSET,
        "builder_version": BUILDER_VERSION,
    }


@lru_cache(maxsize=2)
def load_torch_model(weights: Path):
    """The eval-mode transformers model of a checked checkpoint (cached per folder)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertForSequenceClassification

    check_checkpoint(weights)
    # Eager attention traces into plain ONNX ops.
    model = BertForSequenceClassification.from_pretrained(str(weights), attn_implementation="eager")
    return model.eval()


def write_tokenizer(weights: Path, dst: Path) -> None:
    """The checkpoint's tokenizer.json, or one converted from its vocab.txt by transformers."""
    if (weights / "tokenizer.json").is_file():
        shutil.copyfile(weights / "tokenizer.json", dst)
        return
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(weights)).backend_tokenizer.save(str(dst))


def served_tokenizer_settings(repo: Path) -> dict[str, Any]:
    """text_pair_tokenizer's length settings from its config.pbtxt (the one source of truth)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from contract.model_config import ModelConfig
    from python_backends.text.pairs import DEFAULT_PAIR_BUCKETS

    text = (repo / TOKENIZER_STEP / "config.pbtxt").read_text()
    config = ModelConfig(
        json_format.MessageToDict(text_format.Parse(text, model_config_pb2.ModelConfig()), preserving_proto_field_name=True)
    )
    return {
        "max_length": config.param_int("max_sequence_length", 512, minimum=1),
        "buckets": tuple(config.param_int_list("sequence_buckets", DEFAULT_PAIR_BUCKETS)),
    }


def pair_tokenizer(tokenizer_json: Path, repo: Path):
    from python_backends.text.pairs import PairTokenizer

    return PairTokenizer(tokenizer_json, truncation="refuse", **served_tokenizer_settings(repo))


def check_fits(config: dict[str, Any], tokenizer_json: Path, repo: Path, weights: Path) -> None:
    """The served length fits the checkpoint's positions, the tokenizer's ids its vocabulary."""
    from tokenizers import Tokenizer

    max_length = served_tokenizer_settings(repo)["max_length"]
    positions = int(config.get("max_position_embeddings", 512))
    if max_length > positions:
        raise CheckpointError(
            f"{weights}: max_position_embeddings is {positions}, below text_pair_tokenizer's max_sequence_length "
            f"{max_length}: lower max_sequence_length (and sequence_buckets) in its config.pbtxt"
        )
    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    if vocab > int(config.get("vocab_size", 0)):
        raise CheckpointError(
            f"{weights}: the tokenizer has {vocab} tokens but the model's vocab_size is {config.get('vocab_size')}"
        )


# ---- the graph --------------------------------------------------------------------------


def export_onnx(model, path: Path, properties: dict[str, str] | None = None) -> None:
    """Trace ``model`` (BertForSequenceClassification) to ONNX at ``path``."""
    import onnx
    import torch

    class CrossEncoder(torch.nn.Module):
        def __init__(self, classifier):
            super().__init__()
            self.m = classifier

        def forward(self, input_ids, attention_mask, token_type_ids):
            # The additive mask is built here, not by transformers' masking utilities, whose shape
            # checks the tracer freezes into constants (export/text_encoder.py: padding ignored).
            bert = self.m.bert
            hidden = bert.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
            additive = (1.0 - attention_mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
            tokens = bert.encoder(hidden, attention_mask=additive).last_hidden_state
            return self.m.classifier(self.m.dropout(bert.pooler(tokens)))

    ids = torch.tensor([[101, 2054, 102, 2003, 102, 0], [101, 2054, 2003, 102, 2054, 102]])
    mask = (ids != 0).long()
    types = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]])
    tmp = path.with_suffix(".onnx.tmp")
    axes = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(
            CrossEncoder(model).eval(),
            (ids, mask, types),
            str(tmp),
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["logits"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes, "logits": {0: "batch"}},
            opset_version=OPSET,
            dynamo=False,
        )
    model.eval()  # the exporter restores the mode it found
    graph = onnx.load(str(tmp))
    if properties:
        onnx.helper.set_model_props(graph, properties)
    onnx.save(graph, str(tmp))
    onnx.checker.check_model(str(tmp), full_check=True)
    tmp.replace(path)


def torch_logits(model, pairs) -> np.ndarray:
    """transformers' own forward of the checkpoint (the reference), [n] logits."""
    import torch

    with torch.inference_mode():
        out = model(
            input_ids=torch.from_numpy(pairs.input_ids),
            attention_mask=torch.from_numpy(pairs.attention_mask),
            token_type_ids=torch.from_numpy(pairs.token_type_ids),
        ).logits
    return out.numpy()[:, 0].astype(np.float64)


def evaluate(run, model, tokenizer) -> dict[str, Any]:
    """Gate metrics of ``run`` (feed -> [n, 1] logits) against ``model`` on the gate pairs.

    logit_diff         the largest |ONNX - PyTorch| logit over all pairs
    ranking_agreement  of every two documents of one query whose PyTorch logits are more than
                       2e-3 apart (closer ones are ties either order may break), the fraction
                       ordered the same way
    logit_spread       PyTorch's logit standard deviation over the pairs (a constant model
                       would pass the other two vacuously; reported, not gated)
    """
    diffs, agree, considered, refs = [], 0, 0, []
    for query, documents in gate_pairs():
        pairs = tokenizer.encode(query, documents)
        ref = torch_logits(model, pairs)
        feed = {"input_ids": pairs.input_ids, "attention_mask": pairs.attention_mask, "token_type_ids": pairs.token_type_ids}
        got = np.asarray(run(feed), dtype=np.float64).reshape(-1)
        diffs.append(float(np.abs(got - ref).max()))
        refs.append(ref)
        for a in range(len(ref)):
            for b in range(a + 1, len(ref)):
                if abs(ref[a] - ref[b]) > 2e-3:
                    considered += 1
                    agree += int(np.sign(got[a] - got[b]) == np.sign(ref[a] - ref[b]))
    all_refs = np.concatenate(refs)
    return {
        "logit_diff": max(diffs),
        "ranking_agreement": agree / considered if considered else 1.0,
        "ranked_document_pairs": considered,
        "pairs": int(all_refs.size),
        "logit_spread": float(all_refs.std()),
    }


def onnx_runner(path: Path):
    from export.pipeline import variant_runner

    return variant_runner("fp32", path, "logits")


# ---- install ------------------------------------------------------------------------------


def paths(repo: Path) -> tuple[Path, Path]:
    """(model.onnx of text_cross_encoder, tokenizer.json of text_pair_tokenizer)."""
    return repo / NAME / "1" / "model.onnx", repo / TOKENIZER_STEP / "1" / "tokenizer.json"


def _manifest_path(model_path: Path) -> Path:
    return model_path.with_suffix(".export.json")


def recorded_manifest(repo: Path) -> dict[str, Any] | None:
    """The export manifest, if the model and tokenizer on disk are the ones it describes."""
    model_path, tok_path = paths(repo)
    manifest = _manifest_path(model_path)
    if not (model_path.is_file() and tok_path.is_file() and manifest.is_file()):
        return None
    try:
        recorded = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return None
    if recorded.get("model_sha256") != sha256_file(model_path) or recorded.get("tokenizer_sha256") != sha256_file(tok_path):
        return None
    return recorded


def export(repo: Path, weights: Path, force: bool = False, gate: dict[str, float] | None = None) -> ExportResult:
    """Check, export, gate and (only on a pass) install ``weights`` as text_cross_encoder.

    Raises CheckpointError for a checkpoint of another kind, GateFailed when the graph misses
    ``gate`` (default: gates.toml's [text_cross_encoder.fp32]); either way nothing is installed.
    """
    started = time.perf_counter()
    weights = Path(weights).resolve()
    config = check_checkpoint(weights)
    model_path, tok_path = paths(repo)
    recorded = recorded_manifest(repo)
    if not force and recorded is not None and recorded.get("source") == source_fingerprint(weights):
        log.info("%s: up to date (%s from %s); --force to rebuild", NAME, model_path, weights.name)
        return ExportResult(model_path, True, recorded.get("metrics"), time.perf_counter() - started)
    gate = gate if gate is not None else variants.load_gates().get(NAME, {}).get("fp32")
    if not gate:
        raise RuntimeError(f"no [{NAME}.fp32] gate in {variants.GATES_FILE.name}: nothing is exported ungated")
    model_path.parent.mkdir(parents=True, exist_ok=True)
    tok_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".staging-", dir=model_path.parent) as staging:
        staged_model, staged_tok = Path(staging) / "model.onnx", Path(staging) / "tokenizer.json"
        write_tokenizer(weights, staged_tok)
        check_fits(config, staged_tok, repo, weights)
        log.info("%s: [1/3] %s from %s to ONNX (opset %d, FP32)", NAME, ARCHITECTURE, weights, OPSET)
        model = load_torch_model(weights)
        fingerprint = source_fingerprint(weights)
        export_onnx(model, staged_model, {"weights_sha256": str(fingerprint["weights_sha256"]), "architecture": ARCHITECTURE})
        log.info("%s: [2/3] gate: ONNX Runtime vs transformers on %s", NAME, PAIRS.name)
        metrics = evaluate(onnx_runner(staged_model), model, pair_tokenizer(staged_tok, repo))
        failures = variants.check_gate(metrics, gate)
        if failures:
            raise GateFailed(f"{NAME}: GATE FAILED ({'; '.join(failures)}); nothing installed, the served model is unchanged")
        log.info(
            "%s: gate passed: max logit diff %.2e, ranking agreement %.3f over %d document pairs (logit spread %.3f)",
            NAME,
            metrics["logit_diff"],
            metrics["ranking_agreement"],
            metrics["ranked_document_pairs"],
            metrics["logit_spread"],
        )
        log.info("%s: [3/3] installing %s and %s", NAME, model_path, tok_path)
        os.replace(staged_tok, tok_path)
        os.replace(staged_model, model_path)
    manifest = {
        "model": NAME,
        "architecture": ARCHITECTURE,
        "checkpoint": weights.name,
        "source": fingerprint,
        "model_sha256": sha256_file(model_path),
        "tokenizer_sha256": sha256_file(tok_path),
        "metrics": metrics,
        "gate": gate,
        "gate_pairs": metrics["pairs"],
    }
    _manifest_path(model_path).write_text(json.dumps(manifest, indent=2) + "\n")
    seconds = time.perf_counter() - started
    log.info("%s: wrote %s (%.1f MB) in %.1f s", NAME, model_path, model_path.stat().st_size / 1e6, seconds)
    return ExportResult(model_path, False, metrics, seconds)


# ---- the variant pipeline (export/pipeline.py): FP32 only, gated, recorded in variants.json --


class TextCrossEncoderPipeline:
    """A user's cross-encoder: FP32 ONNX gated on logit difference and ranking (export/gates.toml)."""

    name = NAME
    variants: tuple[str, ...] = ()  # INT8/FP16 need a trained checkpoint to gate ranking on: not built yet
    builder_version = BUILDER_VERSION
    bench_batches = (1, 8, 32)

    def __init__(self, weights: Path | None = None):
        if weights is None:
            raise CheckpointError(f"{NAME} is exported from a checkpoint only: --model {NAME} --weights <checkpoint dir>")
        self.weights = Path(weights).resolve()
        self.repo: Path | None = None

    def export_fp32(self, repo: Path, force: bool) -> ExportResult:
        self.repo = repo
        return export(repo, self.weights, force=force)

    def config_parameters(self) -> dict[str, str]:
        """Where the weights came from, in every served config (model metadata)."""
        return {
            "weights_provenance": f"checkpoint {self.weights.name}",
            "weights_sha256": source_fingerprint(self.weights)["weights_sha256"],
        }

    def describe(self) -> dict[str, Any]:
        return {
            "summary": f"{ARCHITECTURE} (1 label) from checkpoint {self.weights.name}; parity on {PAIRS.name}",
            "weights": "checkpoint",
        }

    def skip_reason(self, variant: str) -> str | None:
        return None

    def build(self, variant: str, version_dir: Path, dst: Path) -> None:
        raise ValueError(f"{NAME} has no builder for variant {variant!r}")

    def evaluate(self, variant: str, path: Path) -> dict[str, Any]:
        assert self.repo is not None, "export_fp32 runs first"
        return evaluate(onnx_runner(path), load_torch_model(self.weights), pair_tokenizer(paths(self.repo)[1], self.repo))

    def bench_feed(self, batch: int) -> dict[str, np.ndarray]:
        assert self.repo is not None, "export_fp32 runs first"
        query, documents = gate_pairs()[0]
        pairs = pair_tokenizer(paths(self.repo)[1], self.repo).encode(query, (documents * batch)[:batch])
        return {"input_ids": pairs.input_ids, "attention_mask": pairs.attention_mask, "token_type_ids": pairs.token_type_ids}
