"""perf.checks.gpu_generation's report: the markdown tables and the float32 verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from perf.checks.gpu_generation import DtypeResult, Parity

# First-step logits of a correct engine differ from transformers' by rounding only
# (about 1e-5 at logits of magnitude ~2 in FP32); a wrong RoPE, mask or weight is >1e-2.
FP32_LOGITS_TOL = 1e-3


def _fmt_gap(p: Parity) -> str:
    if p.first_divergence is None:
        return "-"
    gap = "" if p.gap_at_divergence is None else f" (gap {p.gap_at_divergence:.2e})"
    return f"{p.first_divergence}{gap}"


def format_report(results: list[DtypeResult]) -> str:
    lines = [
        "## Greedy tokens: engine vs transformers generate() one prompt at a time",
        "",
        "| dtype | engine mode | matching prefix | prompts identical | first divergence (reference logit gap) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for p in r.parity:
            lines.append(
                f"| {r.dtype} | {p.mode} | {100 * p.matching_prefix:.1f} % | "
                f"{p.prompts_identical}/{p.num_prompts} | {_fmt_gap(p)} |"
            )
    lines += [
        "",
        "## First-step logits (engine FP32 output vs transformers, cast to FP32)",
        "",
        (
            "| dtype | max abs diff | max abs logit | transformers vs its own float32 tokens "
            "| distinct tokens per reference output |"
        ),
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        yard = "-" if r.hf_vs_hf_float32 is None else f"{100 * r.hf_vs_hf_float32:.1f} % matching prefix"
        lines.append(
            f"| {r.dtype} | {r.logits_max_abs_diff:.3e} | {r.logits_max_abs:.2f} | {yard} | {100 * r.reference_distinct:.0f} % |"
        )
    if any(r.reference_distinct < 0.5 for r in results):
        lines += [
            "",
            (
                "WARNING: the reference repeats itself (under 50 % distinct tokens): the random model "
                "is too flat for token parity to test the attention"
            ),
        ]
    if any(r.throughput for r in results):
        lines += [
            "",
            "## Tokens/s (new tokens per second of wall time, prefill included)",
            "",
            (
                "| dtype | streams | engine | generate() static batch | generate() one at a time | "
                "engine / static | engine / one at a time |"
            ),
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in results:
            for t in r.throughput:
                lines.append(
                    f"| {r.dtype} | {t['streams']} | {t['engine_tok_s']:.0f} | {t['hf_static_batch_tok_s']:.0f} | "
                    f"{t['hf_one_at_a_time_tok_s']:.0f} | {t['engine_tok_s'] / t['hf_static_batch_tok_s']:.2f} | "
                    f"{t['engine_tok_s'] / t['hf_one_at_a_time_tok_s']:.2f} |"
                )
    return "\n".join(lines)


def fp32_failures(results: list[DtypeResult]) -> list[str]:
    """Why float32 parity failed (empty: it passed or float32 was not run)."""
    out = []
    for r in results:
        if r.dtype != "float32":
            continue
        for p in r.parity:
            if not p.identical:
                out.append(
                    f"float32 {p.mode}: {p.num_prompts - p.prompts_identical} prompts differ, first at token {_fmt_gap(p)}"
                )
        if r.logits_max_abs_diff > FP32_LOGITS_TOL:
            out.append(f"float32 first-step logits differ by {r.logits_max_abs_diff:.3e} > {FP32_LOGITS_TOL}")
    return out
