"""perf.bench.gateway_bench's report: the gateway / direct ratios against the targets and the
markdown tables."""

from __future__ import annotations

from collections.abc import Sequence

from perf.bench.gateway_workloads import (
    EMBED_SYSTEMS,
    PEER_SYSTEMS,
    TARGET_EMBED_P99,
    TARGET_EMBED_THROUGHPUT,
    TARGET_P99_VS_PEER,
    TARGET_TOKENS,
    TARGET_TTFT_MS,
    TARGET_VS_PEER,
    WORKLOADS,
)

# --------------------------------------------------------------------------- report


def _fmt(value, digits: int = 1) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _embed_ratio_rows(
    label: str, ours: dict, ref: dict, targets: tuple[float, float], concurrency: int
) -> list[dict[str, object]]:
    """Throughput (ours / ref, at least targets[0]) and P99 (at most targets[1]) of two embeddings cells;
    the targets are written for 32 clients and checked there only."""
    checked = concurrency == 32
    rows = []
    for name, num, den, tgt, above in (
        ("throughput", ours["requests_per_s"], ref["requests_per_s"], targets[0], True),
        ("P99", ours["p99_ms"], ref["p99_ms"], targets[1], False),
    ):
        value = round(num / den, 3) if num and den else None
        met = None if value is None or not checked else (value >= tgt if above else value <= tgt)
        rows.append(
            {
                "name": f"{label} {name}, c{concurrency}",
                "value": value,
                "target": f"{'>=' if above else '<='} {tgt:g}" if checked else "",
                "met": "" if met is None else ("yes" if met else "no"),
                "detail": f"{_fmt(num)} / {_fmt(den)}",
            }
        )
    return rows


def ratios(embed: Sequence[dict], chat: Sequence[dict], embed_concurrency: int) -> list[dict[str, object]]:
    rows = []
    by = {(s["workload"], s["system"]): s for s in embed}
    for workload in WORKLOADS:
        d = by.get((workload, "direct"))
        for system in EMBED_SYSTEMS[1:]:
            g = by.get((workload, system))
            if system in PEER_SYSTEMS or not d or not g:
                continue
            label = f"embeddings {workload}, {system} / direct"
            rows += _embed_ratio_rows(label, g, d, (TARGET_EMBED_THROUGHPUT, TARGET_EMBED_P99), embed_concurrency)
    for peer in PEER_SYSTEMS:
        theirs = by.get(("unique", peer))
        for system in ("direct", "gateway"):
            ours = by.get(("unique", system))
            if not theirs or not ours:
                continue
            label = f"embeddings unique, {system} / {peer}"
            rows += _embed_ratio_rows(label, ours, theirs, (TARGET_VS_PEER, TARGET_P99_VS_PEER), embed_concurrency)
    cb = {(s["system"], s["concurrency"]): s for s in chat}
    for c in sorted({s["concurrency"] for s in chat}):
        g, d = cb.get(("gateway", c)), cb.get(("direct", c))
        if not g or not d:
            continue
        for p in ("p50", "p99"):
            a, b = g[f"ttft_{p}_ms"], d[f"ttft_{p}_ms"]
            value = round(a - b, 1) if a is not None and b is not None else None
            met = None if value is None else value <= TARGET_TTFT_MS
            rows.append(
                {
                    "name": f"chat c{c}, gateway - direct TTFT {p.upper()} (ms)",
                    "value": value,
                    "target": f"<= {TARGET_TTFT_MS:g}",
                    "met": "" if met is None else ("yes" if met else "no"),
                    "detail": f"{_fmt(a)} - {_fmt(b)} ms",
                }
            )
        a, b = g["tokens_per_s"], d["tokens_per_s"]
        value = round(a / b, 3) if a and b else None
        met = None if value is None else value >= TARGET_TOKENS
        rows.append(
            {
                "name": f"chat c{c}, gateway / direct tokens/s",
                "value": value,
                "target": f">= {TARGET_TOKENS:g}",
                "met": "" if met is None else ("yes" if met else "no"),
                "detail": f"{_fmt(a, 2)} / {_fmt(b, 2)}",
            }
        )
    return rows


def markdown(header: Sequence[str], embed: Sequence[dict], chat: Sequence[dict], ratio_rows: Sequence[dict]) -> str:
    lines = list(header)
    if embed:
        lines += [
            "",
            (
                "| embeddings | workload | concurrency | requests/s | P50 ms | P99 ms | max ms | requests | "
                "client CPU ms/request | errors |"
            ),
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for s in embed:
            err = f"{s['errors']}: {s['first_error'][:80]}" if s["errors"] else "0"
            lines.append(
                f"| {s['system']} | {s['workload']} | {s['concurrency']} | {_fmt(s['requests_per_s'])} | "
                f"{_fmt(s['p50_ms'], 2)} | {_fmt(s['p99_ms'], 2)} | {_fmt(s['max_ms'], 2)} | {s['requests']} | "
                f"{_fmt(s['client_cpu_per_request_ms'], 3)} | {err} |"
            )
    if chat:
        lines += [
            "",
            (
                "| chat stream | concurrency | tokens/s | TTFT P50 ms | TTFT P99 ms | TTFT max ms | requests | "
                "tokens per request | errors |"
            ),
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
        ]
        for s in chat:
            err = f"{s['errors']}: {s['first_error'][:80]}" if s["errors"] else "0"
            lines.append(
                f"| {s['system']} | {s['concurrency']} | {_fmt(s['tokens_per_s'], 2)} | {_fmt(s['ttft_p50_ms'])} | "
                f"{_fmt(s['ttft_p99_ms'])} | {_fmt(s['ttft_max_ms'])} | {s['requests']} | "
                f"{','.join(map(str, s['tokens_per_request']))} | {err} |"
            )
    if ratio_rows:
        lines += ["", "| ratio | value | target | met | from |", "| --- | ---: | --- | --- | --- |"]
        for r in ratio_rows:
            lines.append(f"| {r['name']} | {_fmt(r['value'], 3)} | {r['target']} | {r['met']} | {r['detail']} |")
    return "\n".join(lines) + "\n"
