"""Priority classes under overload, side by side in one run (`make priority-bench`).

One server (front door on) with the three class entries (docs/priority-classes.md), unique texts
(every request a cache miss). Phases: ``peak``, the default entry alone under wrk at
``--peak-concurrency`` (its peak rate P); ``interactive alone``, an open-loop probe at
``--probe-rate``; ``overload``, wrk floods default and bulk at ``--overload`` x P while probes of
every class record each latency by status (admitted P50/P99 and refusals per class). The server's
RSS is sampled each second. Writes the tables and raw figures under perf/results/priority-<UTC>/;
exit status 1 when interactive misses its budget, a refusal is not UNAVAILABLE (503), or a probe
gets another error.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from perf.lib import load, options, processes, report, triton_stats, wrk
from perf.lib.paths import ROOT
from perf.lib.stats import percentile_of
from perf.lib.workload import infer_body, sentences
from python_backends.admission.classes import CACHED_ENTRIES, CLASSES

MODELS = tuple(CACHED_ENTRIES.values())
HEADERS = {"Content-Type": "application/json"}


def body(text: str) -> bytes:
    """A request of one text, its answer in JSON."""
    return infer_body([{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}], binary_output=False)[0]


def wrk_script(model: str, texts: Sequence[str], nonce: str, delay_ms: float) -> str:
    """wrk's requests to ``model``, each text made unique; 200, 503 and other answers counted."""
    request = wrk.unique_texts(texts, body("\0"), nonce)
    return wrk.script(f"/v2/models/{model}/infer", HEADERS, request, delay_ms=delay_ms, count_status=True)


async def probe(url: str, model: str, rate: float, seconds: float, texts: Sequence[str], nonce: str) -> load.Tally:
    """Single requests to one entry at ``rate`` per second (open loop): latency per outcome."""

    def make(n: int) -> load.Request:
        return body(f"{texts[n % len(texts)]} ({nonce}-probe-{model}-{n})"), HEADERS

    return await load.open_loop(f"http://{url}/v2/models/{model}/infer", make, rate, seconds)


def row(tally: load.Tally, phase: str, cls: str, model: str) -> dict:
    sent = len(tally.ok) + tally.errors
    other = tally.errors - len(tally.refused)
    return {
        "phase": phase,
        "class": cls,
        "model": model,
        "sent": sent,
        "ok": len(tally.ok),
        **load.latency_ms(tally.ok),
        "refused": len(tally.refused),
        "refused_rate": len(tally.refused) / sent if sent else 0.0,
        "refused_p99_ms": percentile_of([1000 * s for s in tally.refused], 99, empty=None),
        "other_errors": other,
        "first_other": tally.first_error if other else "",
    }


class RssSampler:
    """RSS (MiB) of a process tree, each second, in a thread."""

    def __init__(self, pid: int):
        self.pid, self._stop = pid, threading.Event()
        self.samples: list[tuple[float, float]] = []  # (time, RSS MiB)
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), processes.tree_rss(self.pid) / 2**20))
            self._stop.wait(1.0)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.samples


def _f(v, digits=1) -> str:
    return report.fmt(v, digits, missing="-", thousands=True)


def markdown(rows: Sequence[dict], peak: dict, flood: dict, rss: dict) -> str:
    default, bulk = flood["default"], flood["bulk"]
    lines = [
        f"Default entry's peak (closed loop, {peak['connections']} connections): {peak['rate']:,.0f} requests/s, "
        f"P50 {_f(peak['p50_ms'])} ms, P99 {_f(peak['p99_ms'])} ms.",
        f"Overload offered {flood['offered_rate']:,.0f} requests/s = {flood['offered_rate'] / peak['rate']:.1f} x peak "
        f"(default {default['rate']:,.0f}/s, {default['refused_rate']:.0%} refused; bulk {bulk['rate']:,.0f}/s, "
        f"{bulk['refused_rate']:.0%} refused; other errors {default['other'] + bulk['other']}, socket errors "
        f"{default['socket_errors'] + bulk['socket_errors']}).",
        f"Server RSS (tritonserver and stubs): {rss['before']:,.0f} MiB before, max {rss['max']:,.0f} MiB during "
        f"overload, {rss['after']:,.0f} MiB after.",
        "",
    ]
    header = ["phase", "class (budget)", "sent", "P50 ms", "P99 ms", "max ms", "refused", "refused P99 ms", "other errors"]
    body = [
        (r["phase"], f"{r['class']} ({CLASSES[r['class']].budget_ms} ms)", r["sent"], _f(r["p50_ms"]), _f(r["p99_ms"]))
        + (_f(r["max_ms"]), f"{r['refused']} ({r['refused_rate']:.0%})", _f(r["refused_p99_ms"]), r["other_errors"])
        for r in rows
    ]
    return "\n".join(lines) + report.table(header, body, left=2) + "\n"


def flood_figures(w: dict) -> dict:
    """A flood's rates, refusals and latency from wrk's counts (perf.lib.wrk, count_status)."""
    s = w["duration_us"] / 1e6
    total = w["ok"] + w["unavailable"] + w["other"]
    return {
        "rate": total / s,
        "ok_rate": w["ok"] / s,
        "refused_rate": w["unavailable"] / total if total else 0,
        "other": w["other"],
        "socket_errors": w["socket_errors"],
        **{f"{k}_ms": w[f"{k}_us"] / 1000 for k in ("p50", "p99", "max")},
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = options.parser("perf.bench.priority_bench", __doc__)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of each phase (default 30)")
    p.add_argument("--peak-concurrency", type=int, default=32)
    p.add_argument("--overload", type=float, default=5.0, help="flood rate as a multiple of the default peak")
    p.add_argument("--flood-connections", type=int, default=512, help="wrk connections of the flood, split in two")
    p.add_argument("--probe-rate", type=float, default=20.0, help="requests/s of each class's probe")
    p.add_argument("--precision", default="auto")
    p.add_argument("--out", type=Path, default=None, help="results folder (default perf/results/priority-<UTC time>)")
    return options.finish(p, p.parse_args(argv), argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from export import variants
    from perf.lib.deployment import server_deployment

    say, load_before = report.progress(), report.load_average()
    texts = sentences()
    nonce = f"{os.getpid()}-{int(time.time())}"
    out = report.results_dir(args.out, "priority", stamp="%Y%m%dT%H%M%SZ")
    loadable = tuple(v for v in variants.VARIANTS if v != "trt_plan")
    config_name, _ = variants.resolve_precision(ROOT / "model_repository", ["text_encoder"], args.precision, loadable=loadable)
    with (
        tempfile.TemporaryDirectory(prefix="priority-bench-") as tmp,
        server_deployment(MODELS, Path(tmp), model_config_name=config_name) as server,
    ):
        work, url = Path(tmp), server.http_url.removeprefix("http://")
        say(f"server ready at {url} (variant {config_name or 'fp32'}); load average {load_before}")

        def script(cls: str, kind: str, delay_ms: float) -> Path:
            path = work / f"{cls}-{kind}.lua"
            path.write_text(wrk_script(CACHED_ENTRIES[cls], texts, f"{nonce}-{kind}", delay_ms))
            return path

        peak_script = script("default", "peak", 0.0)
        wrk.run(url, peak_script, args.peak_concurrency, 3, timeout_s=30.0)  # warm-up
        peak = flood_figures(wrk.run(url, peak_script, args.peak_concurrency, args.duration, timeout_s=30.0))
        peak |= {"connections": args.peak_concurrency, "rate": peak["ok_rate"]}
        say(
            f"default peak {peak['rate']:,.0f}/s P50 {peak['p50_ms']:.1f} P99 {peak['p99_ms']:.1f} ms "
            f"(refused {peak['refused_rate']:.0%}, other {peak['other']})"
        )
        alone = asyncio.run(probe(url, CACHED_ENTRIES["interactive"], args.probe_rate, args.duration, texts, f"{nonce}-alone"))
        rows = [row(alone, "alone", "interactive", CACHED_ENTRIES["interactive"])]
        say(f"interactive alone: {rows[-1]}")

        # overload: each flood connection waits between its requests so that all of them offer
        # about overload x peak once most answers are quick refusals (wrk paces by a delay after
        # each answer: the admitted answers' latency slows it, so it is subtracted); the rate
        # actually offered is measured and reported.
        conns = max(2, args.flood_connections // 2)
        delay_ms = max(0.0, 1000.0 * conns / (args.overload * peak["rate"] / 2) - peak["p50_ms"])
        floods = {cls: script(cls, "flood", delay_ms) for cls in ("default", "bulk")}
        sampler = RssSampler(server.process.pid).start()
        time.sleep(1.5)
        before_rss = sampler.samples[-1][1]
        results: dict[str, dict] = {}
        threads = [
            threading.Thread(target=lambda c=cls: results.__setitem__(c, wrk.run(url, floods[c], conns, args.duration + 4, 30.0)))
            for cls in floods
        ]
        for t in threads:
            t.start()
        time.sleep(2.0)  # the flood reaches its steady state
        stats_before = triton_stats.snapshot(url)

        async def probes() -> list[load.Tally]:
            return await asyncio.gather(
                *(probe(url, CACHED_ENTRIES[c], args.probe_rate, args.duration, texts, f"{nonce}-over") for c in CLASSES)
            )

        tallies = asyncio.run(probes())
        per_model = triton_stats.per_request(stats_before, triton_stats.snapshot(url))
        for t in threads:
            t.join()
        during = [s for _, s in sampler.samples]
        time.sleep(3.0)
        rss_samples = sampler.stop()
    rss = {"before": before_rss, "max": max(during), "after": rss_samples[-1][1]}
    flood: dict = {cls: flood_figures(results[cls]) for cls in floods}
    flood["offered_rate"] = flood["default"]["rate"] + flood["bulk"]["rate"]
    rows += [row(tally, "overload", cls, CACHED_ENTRIES[cls]) for cls, tally in zip(CLASSES, tallies)]
    lines = [
        *report.header("Priority classes under overload", "perf.bench.priority_bench", args.argv, load_before),
        "- 2-core machines are shared: compare classes within one run",
        "",
        markdown(rows, peak, flood, rss),
        "Per request during the overload (Triton's statistics): model, requests, batch, queue ms, compute ms",
        *(f"- {k}: {v['requests']}, {v['batch']}, {v['queue_ms']}, {v['compute_ms']}" for k, v in sorted(per_model.items())),
    ]
    data: dict[str, object] = {"peak": peak, "rows": rows, "flood": flood, "rss": rss, "rss_samples": rss_samples}
    data |= {"per_model_overload": per_model, "args": vars(args) | {"out": str(out)}, "variant": config_name}
    report.write(out, "\n".join(lines) + "\n", data, say=say)
    inter = next(r for r in rows if r["phase"] == "overload" and r["class"] == "interactive")
    budget = CLASSES["interactive"].budget_ms
    failures = []
    if inter["p99_ms"] is None or inter["p99_ms"] > budget:
        failures.append(f"interactive P99 {inter['p99_ms']} ms over its {budget} ms budget")
    if any(r["other_errors"] for r in rows):
        failures.append(
            "a probe got an error other than UNAVAILABLE: " + "; ".join(r["first_other"] for r in rows if r["other_errors"])
        )
    if any(flood[c]["other"] or flood[c]["socket_errors"] for c in floods):
        failures.append("the flood got errors other than UNAVAILABLE, or dropped connections")
    for f in failures:
        say("FAIL: " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
