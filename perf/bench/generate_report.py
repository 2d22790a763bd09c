"""perf.bench.generate_bench's report: the ratios its targets are written in, and the tables."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perf.lib.generation_systems import PEERS

if TYPE_CHECKING:  # imported where they are used: the in-process systems need neither
    pass


# --------------------------------------------------------------------------- report


# The targets, checked (not enforced) in the printed ratios.
TARGET_ENGINE_VS_NAIVE = 10.0
TARGET_SERVED_VS_ENGINE = 0.9
TARGET_CACHED_TTFT = 0.3
# Ours served over each peer, tokens/s per concurrency: >= 0.9x llama.cpp and >= 1.0x OpenVINO alone,
# >= 1.0x the better peer at 16 and 32 streams; TTFT P50 at 16 streams <= llama.cpp's.
TARGET_VS_PEER = {"llama": {1: 0.9, 16: 1.0, 32: 1.0}, "openvino": {1: 1.0, 16: 1.0, 32: 1.0}}
PEER_NAMES = {"llama": "llama.cpp", "openvino": "OpenVINO GenAI"}


def _fmt(value, digits: int = 1) -> str:
    if value is None or value == "":
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def ratios(
    args, summaries: dict[tuple[str, int], dict], prefix: dict | None, prefill: Sequence[dict] = ()
) -> list[dict[str, Any]]:
    def tps(key, c):
        s = summaries.get((key, c))
        return s["tokens_per_s"] if s and s["tokens_per_s"] else None

    def ratio(name, num, den, target=None, above=True, detail=""):
        value = round(num / den, 3) if num and den else None
        met = None if value is None or target is None else (value >= target if above else value <= target)
        return {
            "name": name,
            "value": value,
            "target": "" if target is None else f"{'>=' if above else '<='} {target:g}",
            "met": "" if met is None else ("yes" if met else "no"),
            "detail": detail,
        }

    top = max(args.concurrency)
    out = []
    for c in sorted(args.concurrency, reverse=True):
        e, n = tps("engine", c), tps("naive", c)
        out.append(
            ratio(
                f"engine / naive tokens/s, {c} streams",
                e,
                n,
                TARGET_ENGINE_VS_NAIVE if c == top else None,
                detail=f"{_fmt(e)} / {_fmt(n)}",
            )
        )
    for c in sorted(args.concurrency, reverse=True):
        for key in ("grpc", "http"):
            s, e = tps(key, c), tps("engine", c)
            out.append(
                ratio(
                    f"Triton {key} / engine tokens/s, {c} streams", s, e, TARGET_SERVED_VS_ENGINE, detail=f"{_fmt(s)} / {_fmt(e)}"
                )
            )
    for c in sorted(args.concurrency, reverse=True):  # prompt-lookup drafts on over off
        e, n = tps("engine", c), tps("nodraft", c)
        if e and n:
            out.append(ratio(f"engine drafts on / off tokens/s, {c} streams", e, n, detail=f"{_fmt(e)} / {_fmt(n)}"))
    for c in sorted(args.concurrency, reverse=True):  # the peers: ours over each
        for peer_key in PEERS:
            peer = summaries.get((peer_key, c))
            if not peer:
                continue
            name = PEER_NAMES[peer_key]
            for key in ("grpc", "http", "engine"):
                ours = summaries.get((key, c))
                if not ours:
                    continue
                who = "engine" if key == "engine" else f"Triton {key}"
                out.append(
                    ratio(
                        f"{who} / {name} tokens/s, {c} streams",
                        ours["tokens_per_s"],
                        peer["tokens_per_s"],
                        TARGET_VS_PEER[peer_key].get(c) if key != "engine" else None,
                        detail=f"{_fmt(ours['tokens_per_s'])} / {_fmt(peer['tokens_per_s'])}",
                    )
                )
                if key == "engine":
                    continue
                out.append(
                    ratio(
                        f"{who} / {name} TTFT P50 (lower is better), {c} streams",
                        ours["ttft_p50_ms"],
                        peer["ttft_p50_ms"],
                        1.0 if c == 16 and peer_key == "llama" else None,
                        above=False,
                        detail=f"{_fmt(ours['ttft_p50_ms'])} / {_fmt(peer['ttft_p50_ms'])} ms",
                    )
                )
                out.append(
                    ratio(
                        f"{who} / {name} ITL P99 (lower is better), {c} streams",
                        ours["itl_p99_ms"],
                        peer["itl_p99_ms"],
                        detail=f"{_fmt(ours['itl_p99_ms'])} / {_fmt(peer['itl_p99_ms'])} ms",
                    )
                )
    peer = next((r for r in prefill if r["system"] == "llama"), None)
    for r in prefill:
        if peer is not None and r is not peer:
            out.append(
                ratio(
                    f"prefill {r['system']} / llama.cpp prompt tokens/s (P50, one long prompt at a time)",
                    r["prompt_tokens_per_s_p50"],
                    peer["prompt_tokens_per_s_p50"],
                    detail=f"{_fmt(r['prompt_tokens_per_s_p50'])} / {_fmt(peer['prompt_tokens_per_s_p50'])}",
                )
            )
    if prefix is not None:
        out.append(
            ratio(
                "TTFT prefix cached / uncached (engine, P50)",
                prefix["ttft_cached_p50_ms"],
                prefix["ttft_uncached_p50_ms"],
                TARGET_CACHED_TTFT,
                above=False,
                detail=f"{_fmt(prefix['ttft_cached_p50_ms'])} / {_fmt(prefix['ttft_uncached_p50_ms'])} ms",
            )
        )
    return out


def markdown(header: Sequence[str], cells: Sequence[dict], ratio_rows: Sequence[dict], prefix: dict | None) -> str:
    lines = list(header) + [
        "",
        (
            "| system | concurrency | tokens/s | TTFT P50 ms | TTFT P99 ms | TTFT max ms | ITL P50 ms | ITL P99 ms | "
            "ITL max ms | requests (finished) | notes |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for s in cells:
        notes = []
        if s["ttft_censored"]:
            notes.append(f"{s['ttft_censored']} still waiting at the window's end (TTFT a lower bound)")
        if s["errors"]:
            notes.append(f"{s['errors']} errors: {s['first_error'][:120]}")
        lines.append(
            f"| {s['system']} | {s['concurrency']} | {_fmt(s['tokens_per_s'])} | {_fmt(s['ttft_p50_ms'])} | "
            f"{_fmt(s['ttft_p99_ms'])} | {_fmt(s['ttft_max_ms'])} | {_fmt(s['itl_p50_ms'])} | "
            f"{_fmt(s['itl_p99_ms'])} | {_fmt(s['itl_max_ms'])} | {s['requests']} ({s['finished']}) | "
            f"{'; '.join(notes)} |"
        )
    if prefix is not None:
        lines += [
            "",
            "| prefix caching (engine, one request at a time) | TTFT P50 ms | prompt tokens computed |",
            "| --- | ---: | ---: |",
            (
                f"| on, second request onward | {_fmt(prefix['ttft_cached_p50_ms'])} | "
                f"{_fmt(prefix['mean_prompt_tokens_computed_cached'])} of {_fmt(prefix['mean_prompt_tokens'])} |"
            ),
            f"| on, first request (fills the cache) | {_fmt(prefix['ttft_first_on_ms'])} | |",
            f"| off | {_fmt(prefix['ttft_uncached_p50_ms'])} | {_fmt(prefix['mean_prompt_tokens'])} |",
        ]
    lines += ["", "| ratio | value | target | met | from |", "| --- | ---: | --- | --- | --- |"]
    for r in ratio_rows:
        lines.append(f"| {r['name']} | {_fmt(r['value'], 2)} | {r['target']} | {r['met']} | {r['detail']} |")
    return "\n".join(lines) + "\n"


def pa_display(path: Path) -> str:
    from perf.lib.perf_analyzer import display_path

    return display_path(path)
