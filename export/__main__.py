"""`python -m export`: export every served model in every precision this machine can build.

For each model: FP32 ONNX, then the derived variants (ONNX Runtime CPU fusions, INT8, FP16,
TensorRT), each gated against the FP32 PyTorch reference (export/gates.toml) and kept only
when it passes. Reports go to export/reports/<model>.{md,json}. Exits 1 when any variant
missed its gate or failed to build; skipped variants (no GPU, no TensorRT) say why.

  python -m export                         # all models, all variants, speed measured
  python -m export --no-speed              # what `make serve` / `make test` run: no timing
  python -m export --model text_encoder --variant int8 --force
  python -m export --update-docs           # also refresh docs/export-report.md

The generation model (text_generation): export/generation.py converts it to safetensors and
gates it against its source (python -m export.generation for --weights and --dtype); its
precision variants (BF16, INT4 blocks) are gated against the FP32 engine on this CPU by
export/generation_gate.py.

The cross-encoder reranker (text_cross_encoder, served by text_reranker) is exported only on
request, from a team's own checkpoint: --model text_cross_encoder --weights <checkpoint dir>
(export/cross_encoder.py).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS_REPORT = ROOT / "docs" / "export-report.md"

# model -> "module:class" of its pipeline (export/pipeline.py: ModelPipeline)
PIPELINES = {
    "text_encoder": "export.text_encoder:TextEncoderPipeline",
    "image_classifier": "export.image_classifier:ImageClassifierPipeline",
    "image_classifier_resnet50": "export.image_classifier:ResNet50Pipeline",
    "text_cross_encoder": "export.cross_encoder:TextCrossEncoderPipeline",
}
# Models whose exporter takes --weights (a checkpoint of the model's own architecture).
TAKES_WEIGHTS = ("image_classifier", "image_classifier_resnet50", "text_cross_encoder")
# Exported only when named, from a user's checkpoint (--weights): never by a plain run.
ON_REQUEST = ("text_cross_encoder",)


# Models exported outside the variant pipeline: model -> "module" with export_for_serving,
# report and to_markdown.
SINGLE = {"text_generation": "export.generation"}


def load_pipeline(name: str, **kwargs):
    module, cls = PIPELINES[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


def _versus_seeds(reports: list[dict]) -> str:
    """What INT8 loses and gains here, next to the seed articles' ResNet-50 table."""
    lines = [
        "",
        "### INT8: what it costs and buys, next to the seed articles",
        "",
        "The seeds' ResNet-50 (GPU): FP32 76.5 % top-1 / 120 ms, post-training INT8 74.2 % / 65 ms, "
        "QAT 75.8 % / 63 ms: 2.3 points of accuracy lost for about 1.8x.",
        "",
    ]
    for report in reports:
        rows = {r["variant"]: r for r in report["variants"]}
        int8 = rows.get("int8")
        if not int8 or "speedup_vs_fp32_b1" not in int8:
            continue
        m = int8["metrics"]
        loss = (
            f"worst held-out text cosine {m['cosine']:.4f} (mean {m['mean_cosine']:.4f})"
            if "cosine" in m
            else f"top-1 agreement {m.get('top1_agreement', float('nan')):.3f}, max probability difference "
            f"{m.get('prob_diff', float('nan')):.3f}"
        )
        lines.append(
            f"- {report['model']} INT8 ({int8['status']}): {loss}; {int8['speedup_vs_fp32_b1']}x at batch 1, "
            f"{int8['speedup_vs_fp32_best']}x at the best batch, {int8['size_mb']} MB vs "
            f"{rows['fp32']['size_mb']} MB."
        )
    return "\n".join(lines) + "\n"


def _section(page: str, model: str) -> str:
    """The ``### <model>`` section of a report page (up to the next heading), or ''."""
    import re

    m = re.search(rf"^### {re.escape(model)}\n.*?(?=^##|\Z)", page, re.M | re.S)
    return m.group(0).rstrip("\n") + "\n" if m else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted([*PIPELINES, *SINGLE]), action="append", help="only this model (repeatable)")
    parser.add_argument("--variant", action="append", help="only these derived variants (repeatable; fp32 is always built)")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository", help="model repository to write into")
    parser.add_argument("--force", action="store_true", help="rebuild even what is up to date")
    parser.add_argument("--no-speed", action="store_true", help="skip the in-process speed measurement")
    parser.add_argument(
        "--weights",
        type=Path,
        help="with one --model: image_classifier_resnet50 (a torchvision-style ResNet-50 state_dict) or "
        "image_classifier (an EfficientNet-Lite0 state_dict in efficientnet_pytorch naming) or "
        "text_cross_encoder (a Hugging Face folder of a BertForSequenceClassification with 1 label)",
    )
    parser.add_argument("--update-docs", action="store_true", help=f"write the summary to {DOCS_REPORT.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if args.update_docs and args.no_speed:
        parser.error("--update-docs needs the speed measurement; drop --no-speed")
    if args.weights is not None and (not args.model or len(args.model) != 1 or args.model[0] not in TAKES_WEIGHTS):
        parser.error(
            f"--weights needs exactly one --model of {', '.join(TAKES_WEIGHTS)} "
            "(e.g. --model image_classifier_resnet50 --weights ckpt.pth)"
        )
    if args.model and set(args.model) & set(ON_REQUEST) and args.weights is None:
        parser.error("--model text_cross_encoder needs --weights <checkpoint dir> (a BertForSequenceClassification with 1 label)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s export %(message)s", datefmt="%H:%M:%S")
    log = logging.getLogger("export")

    from export import pipeline

    failed, reports, singles = [], [], []
    for name in args.model or [*(m for m in PIPELINES if m not in ON_REQUEST), *SINGLE]:
        if name in SINGLE:
            module = importlib.import_module(SINGLE[name])
            try:
                singles.append(
                    (module, module.report(module.export_for_serving(args.repository, force=args.force, speed=not args.no_speed)))
                )
            except Exception as exc:  # report every model, then fail
                log.exception("%s: export failed", name)
                failed.append(f"{name} (export failed: {exc})")
            continue
        kwargs = {"weights": args.weights} if name in TAKES_WEIGHTS else {}
        try:
            report = pipeline.run(
                load_pipeline(name, **kwargs),
                args.repository,
                force=args.force,
                speed=not args.no_speed,
                only=tuple(args.variant) if args.variant else None,
            )
        except Exception as exc:  # noqa: BLE001 - report every model, then fail
            log.exception("%s: export failed: %s", name, exc)
            failed.append(f"{name} (export failed: {exc})")
            continue
        reports.append(report)
        for row in report["variants"]:
            if row["status"] in ("failed", "error"):
                failed.append(f"{name}/{row['variant']} ({row['status']}: {row['reason']})")
    for report in reports:
        print(pipeline.to_markdown(report))
    for module, row in singles:
        print(module.to_markdown(row))
    if args.update_docs and (reports or singles):
        # Models not exported in this run (--model) keep their last full report in the page:
        # the saved JSON, else their section of the page as it stands.
        import json

        previous = DOCS_REPORT.read_text() if DOCS_REPORT.is_file() else ""
        done = {r["model"]: r for r in reports}
        sections, kept_lines, in_order = [], [], []  # in_order: the reports in the page's order
        for name in (m for m in PIPELINES if m not in ON_REQUEST):
            saved = pipeline.REPORTS / f"{name}.json"
            if name in done:
                in_order.append(done[name])
                sections.append(pipeline.to_markdown(done[name]))
            elif saved.is_file():
                in_order.append(json.loads(saved.read_text()))
                sections.append(pipeline.to_markdown(in_order[-1]))
            else:
                kept = _section(previous, name)
                if kept:
                    sections.append(kept)
                    kept_lines += [line for line in previous.splitlines() if line.startswith(f"- {name} INT8")]
        DOCS_REPORT.parent.mkdir(exist_ok=True)
        DOCS_REPORT.write_text(
            "# Export report (latest)\n\nGenerated by `make export-report` (`python -m export --update-docs`) "
            f"on {time.strftime('%Y-%m-%d', time.gmtime())}. Per-model JSON: `export/reports/` (not in git).\n\n"
            "Parity is against the FP32 PyTorch reference on held-out data; speed is in-process ONNX Runtime "
            "on this machine's CPU, variants measured side by side in interleaved rounds (medians).\n\n"
            + "\n".join(sections)
            + _versus_seeds(in_order).rstrip("\n")
            + "".join("\n" + line for line in kept_lines)
            + "\n"
            + "".join("\n" + module.to_markdown(row) for module, row in singles)
        )
        log.info("wrote %s", DOCS_REPORT)
    from export.lanes import render_all

    for lane in render_all(args.repository):  # priority-class lanes follow the configs just written
        log.info("lane %s rendered", lane.name)
    if failed:
        print("export: FAILED: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
