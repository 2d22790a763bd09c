"""Priority classes under overload, side by side in one run (`make priority-bench`).

One server (front door on, the served precision) with the three class entries
(docs/priority-classes.md). Unique texts, so every request is a cache miss and reaches its
lane. Phases:

1. ``peak``: the default entry alone, closed loop, ``--peak-concurrency`` connections (wrk):
   its peak rate P (successful requests/s).
2. ``interactive alone``: a paced probe of the interactive entry (``--probe-rate`` per second).
3. ``overload``: wrk floods the default and bulk entries at ``--overload`` x P in total
   (paced connections, half each), while paced probes measure every class: interactive, and
   default and bulk requests sent among the flood, each latency recorded by status, so the
   admitted P50/P99 and the refusals' latency are per class.

Memory: the RSS of the server's process tree (tritonserver and every stub) sampled each second.
Prints a table per phase and class and writes it with the raw figures under
perf/results/priority-<UTC>/. Exit status 1 when interactive misses its budget under
overload, a refusal is not UNAVAILABLE (HTTP 503), or any probe got another error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.lib import report, wrk  # noqa: E402 (after the sys.path line)
from perf.lib.stats import percentile_of  # noqa: E402 (after the sys.path line)
from python_backends.admission.classes import CACHED_ENTRIES, CLASSES  # noqa: E402 (after the sys.path line)

SENTENCES = ROOT / "perf" / "data" / "sentences_16tok.json"
MODELS = tuple(CACHED_ENTRIES.values())


def body(text: str) -> bytes:
    return json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}).encode()


def wrk_script(model: str, sentences: Sequence[str], nonce: str, delay_ms: float) -> str:
    """wrk's requests to ``model``, each text made unique; 200, 503 and other answers counted."""
    request = (
        wrk.lua_list("texts", [json.dumps(s)[1:-1] for s in sentences]) + "request = function()\n  n = n + 1\n"
        '  local b = \'{"inputs":[{"name":"TEXT","shape":[1,1],"datatype":"BYTES","data":["\' .. texts[(n % #texts) + 1] ..\n'
        f"            ' ({nonce}-' .. tid .. '-' .. n .. ')\"]}}]}}'\n"
        "  return wrk.format('POST', path, headers, b)\nend\n"
    )
    return wrk.script(
        f"/v2/models/{model}/infer", {"Content-Type": "application/json"}, request, delay_ms=delay_ms, count_status=True
    )


def run_wrk(url: str, script: Path, connections: int, seconds: float) -> dict:
    return wrk.run(url, script, connections, seconds, timeout_s=30.0)


@dataclass
class Probe:
    """Paced single requests to one entry from one thread; latency per outcome."""

    url: str
    model: str
    rate: float
    nonce: str
    sentences: Sequence[str]
    ok_ms: list = field(default_factory=list)
    unavailable_ms: list = field(default_factory=list)
    other: list = field(default_factory=list)

    def run(self, seconds: float) -> None:
        period, n = 1.0 / self.rate, 0
        end = time.monotonic() + seconds
        next_at = time.monotonic()
        while time.monotonic() < end:
            n += 1
            text = f"{self.sentences[n % len(self.sentences)]} ({self.nonce}-probe-{self.model}-{n})"
            req = urllib.request.Request(
                f"http://{self.url}/v2/models/{self.model}/infer", data=body(text), headers={"Content-Type": "application/json"}
            )
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
                self.ok_ms.append((time.perf_counter() - t0) * 1000)
            except urllib.error.HTTPError as e:
                ms = (time.perf_counter() - t0) * 1000
                text = e.read().decode(errors="replace")[:200]
                if e.code == 503:
                    self.unavailable_ms.append(ms)
                else:
                    self.other.append(f"{e.code} {text}")
            except Exception as e:  # noqa: BLE001 - a dropped connection is a finding
                self.other.append(f"{type(e).__name__}: {e}")
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))

    def row(self, phase: str, cls: str) -> dict:
        total = len(self.ok_ms) + len(self.unavailable_ms) + len(self.other)
        return {
            "phase": phase,
            "class": cls,
            "model": self.model,
            "sent": total,
            "ok": len(self.ok_ms),
            "p50_ms": percentile_of(self.ok_ms, 50, empty=None),
            "p99_ms": percentile_of(self.ok_ms, 99, empty=None),
            "max_ms": max(self.ok_ms) if self.ok_ms else None,
            "refused": len(self.unavailable_ms),
            "refused_rate": len(self.unavailable_ms) / total if total else 0.0,
            "refused_p99_ms": percentile_of(self.unavailable_ms, 99, empty=None),
            "other_errors": len(self.other),
            "first_other": self.other[0] if self.other else "",
        }


def model_stats(url: str) -> dict:
    """Per model: requests, executions, queue and compute nanoseconds (Triton's statistics)."""
    with urllib.request.urlopen(f"http://{url}/v2/models/stats", timeout=10) as r:
        data = json.loads(r.read())
    out = {}
    for m in data.get("model_stats", []):
        s = m["inference_stats"]
        key = f"{m['name']}/{m['version']}"
        out[key] = {
            "count": s["success"]["count"],
            "executions": m.get("execution_count", 0),
            "queue_ns": s["queue"]["ns"],
            "compute_ns": s["compute_infer"]["ns"],
        }
    return out


def stats_delta(before: dict, after: dict) -> dict:
    out = {}
    for key, a in after.items():
        b = before.get(key, {"count": 0, "executions": 0, "queue_ns": 0, "compute_ns": 0})
        n = a["count"] - b["count"]
        if n > 0:
            out[key] = {
                "requests": n,
                "per_execution": round(n / max(1, a["executions"] - b["executions"]), 1),
                "queue_ms": round((a["queue_ns"] - b["queue_ns"]) / n / 1e6, 2),
                "compute_ms": round((a["compute_ns"] - b["compute_ns"]) / n / 1e6, 2),
            }
    return out


class RssSampler:
    """RSS (MiB) of a process tree, each second, in a thread."""

    def __init__(self, pid: int):
        self.pid, self._stop = pid, threading.Event()
        self.samples: list[tuple[float, float]] = []  # (time, RSS MiB)
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _tree(self) -> list[int]:
        pids, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            pids.append(p)
            try:
                for t in os.listdir(f"/proc/{p}/task"):
                    todo += [int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
            except OSError:
                pass
        return pids

    def _rss(self) -> float:
        total = 0
        for p in self._tree():
            try:
                for line in Path(f"/proc/{p}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                pass
        return total / 1024.0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._rss()))
            self._stop.wait(1.0)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.samples


def _f(v, digits=1) -> str:
    return report.fmt(v, digits, missing="-", thousands=True)


def markdown(rows: Sequence[dict], peak: dict, flood: dict, rss: dict) -> str:
    lines = [
        f"Default entry's peak (closed loop, {peak['connections']} connections): {peak['rate']:,.0f} requests/s, "
        f"P50 {_f(peak['p50_ms'])} ms, P99 {_f(peak['p99_ms'])} ms.",
        f"Overload offered {flood['offered_rate']:,.0f} requests/s = {flood['offered_rate'] / peak['rate']:.1f} x peak "
        f"(default {flood['default']['rate']:,.0f}/s, {flood['default']['refused_rate']:.0%} refused; bulk "
        f"{flood['bulk']['rate']:,.0f}/s, {flood['bulk']['refused_rate']:.0%} refused; other errors "
        f"{flood['default']['other'] + flood['bulk']['other']}, socket errors "
        f"{flood['default']['socket_errors'] + flood['bulk']['socket_errors']}).",
        f"Server RSS (tritonserver and stubs): {rss['before']:,.0f} MiB before, max {rss['max']:,.0f} MiB during "
        f"overload, {rss['after']:,.0f} MiB after.",
        "",
        "| phase | class (budget) | sent | P50 ms | P99 ms | max ms | refused | refused P99 ms | other errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['phase']} | {r['class']} ({CLASSES[r['class']].budget_ms} ms) | {r['sent']} | {_f(r['p50_ms'])} | "
            f"{_f(r['p99_ms'])} | {_f(r['max_ms'])} | {r['refused']} ({r['refused_rate']:.0%}) | "
            f"{_f(r['refused_p99_ms'])} | {r['other_errors']} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.priority_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=30.0, help="seconds of each phase (default 30)")
    p.add_argument("--peak-concurrency", type=int, default=32)
    p.add_argument("--overload", type=float, default=5.0, help="flood rate as a multiple of the default peak")
    p.add_argument("--flood-connections", type=int, default=512, help="wrk connections of the flood, split in two")
    p.add_argument("--probe-rate", type=float, default=20.0, help="requests/s of each class's probe")
    p.add_argument(
        "--interactive-model",
        default=CACHED_ENTRIES["interactive"],
        help="the model the interactive probe calls (e.g. text_embedding_interactive, the lane without the cache)",
    )
    p.add_argument("--precision", default="auto")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from export import variants
    from perf.lib.deployment import server_deployment

    def say(m: str) -> None:
        print(f"[priority-bench {time.strftime('%H:%M:%S')}] {m}", flush=True)

    sentences = [row["TEXT"]["content"][0] for row in json.loads(SENTENCES.read_text())["data"]]
    nonce = f"{os.getpid()}-{int(time.time())}"
    out = report.results_dir(args.out, "priority", stamp="%Y%m%dT%H%M%SZ")
    work = Path(tempfile.mkdtemp(prefix="priority-bench-"))
    repo = ROOT / "model_repository"
    config_name, _ = variants.resolve_precision(
        repo, ["text_encoder"], args.precision, loadable=tuple(v for v in variants.VARIANTS if v != "trt_plan")
    )
    server = server_deployment((*MODELS, args.interactive_model), work, model_config_name=config_name).triton
    server.start()
    try:
        server.wait_ready(timeout=300)
        url = server.http_url.removeprefix("http://")
        load_start = os.getloadavg()[0]
        say(f"server ready at {url} (variant {config_name or 'fp32'}); load average {load_start:.1f}")
        scripts = {}
        for cls, model in CACHED_ENTRIES.items():
            for kind, delay in (("peak", 0.0),):
                scripts[(cls, kind)] = work / f"{cls}-{kind}.lua"
                scripts[(cls, kind)].write_text(wrk_script(model, sentences, nonce + "-" + kind, delay))
        # warm-up, then the peak of the default entry
        run_wrk(url, scripts[("default", "peak")], args.peak_concurrency, 3)
        r = run_wrk(url, scripts[("default", "peak")], args.peak_concurrency, args.duration)
        seconds = r["duration_us"] / 1e6
        peak = {
            "connections": args.peak_concurrency,
            "rate": r["ok"] / seconds,
            "p50_ms": r["p50_us"] / 1000,
            "p99_ms": r["p99_us"] / 1000,
            "refused": r["unavailable"],
            "other": r["other"],
        }
        say(
            f"default peak {peak['rate']:,.0f}/s P50 {peak['p50_ms']:.1f} P99 {peak['p99_ms']:.1f} ms "
            f"(refused {r['unavailable']}, other {r['other']})"
        )
        rows = []
        probe = Probe(url, args.interactive_model, args.probe_rate, nonce + "-alone", sentences)
        probe.run(args.duration)
        rows.append(probe.row("alone", "interactive"))
        say(f"interactive alone: {rows[-1]}")

        # overload: each flood connection waits between its requests so that all of them offer
        # about overload x peak once most answers are quick refusals (wrk paces by a delay after
        # each answer: the admitted answers' latency slows it, so it is subtracted); the rate
        # actually offered is measured and reported.
        conns = max(2, args.flood_connections // 2)
        per_class_rate = args.overload * peak["rate"] / 2
        delay_ms = max(0.0, 1000.0 * conns / per_class_rate - peak["p50_ms"])
        for cls in ("default", "bulk"):
            scripts[(cls, "flood")] = work / f"{cls}-flood.lua"
            scripts[(cls, "flood")].write_text(wrk_script(CACHED_ENTRIES[cls], sentences, nonce + "-flood", delay_ms))
        sampler = RssSampler(server.process.pid).start()
        time.sleep(1.5)
        before_rss = sampler.samples[-1][1]
        results: dict[str, dict] = {}
        threads: list[threading.Thread] = []
        for cls in ("default", "bulk"):
            t = threading.Thread(
                target=lambda c=cls: results.__setitem__(c, run_wrk(url, scripts[(c, "flood")], conns, args.duration + 4))
            )
            threads.append(t)
            t.start()
        time.sleep(2.0)  # the flood reaches its steady state
        entries = {**CACHED_ENTRIES, "interactive": args.interactive_model}
        probes = {cls: Probe(url, entries[cls], args.probe_rate, nonce + "-over", sentences) for cls in CLASSES}
        pthreads = [threading.Thread(target=p.run, args=(args.duration,)) for p in probes.values()]
        stats_before = model_stats(url)
        for t in pthreads:
            t.start()
        for t in pthreads:
            t.join()
        per_model = stats_delta(stats_before, model_stats(url))
        for t in threads:
            t.join()
        during = [s for _, s in sampler.samples]
        time.sleep(3.0)
        rss_samples = sampler.stop()
        rss = {"before": before_rss, "max": max(during), "after": rss_samples[-1][1]}
        flood = {}
        for cls in ("default", "bulk"):
            w = results[cls]
            s = w["duration_us"] / 1e6
            total = w["ok"] + w["unavailable"] + w["other"]
            flood[cls] = {
                "rate": total / s,
                "ok_rate": w["ok"] / s,
                "refused_rate": w["unavailable"] / total if total else 0,
                "other": w["other"],
                "socket_errors": w["socket_errors"],
                "p50_ms": w["p50_us"] / 1000,
                "p99_ms": w["p99_us"] / 1000,
                "max_ms": w["max_us"] / 1000,
            }
        flood["offered_rate"] = flood["default"]["rate"] + flood["bulk"]["rate"]
        for cls, p in probes.items():
            rows.append(p.row("overload", cls))
        stats_lines = [
            "",
            "Per request during the overload (Triton's statistics): model, requests, per execution, queue ms, compute ms",
        ] + [
            f"- {k}: {v['requests']}, {v['per_execution']}, {v['queue_ms']}, {v['compute_ms']}"
            for k, v in sorted(per_model.items())
        ]
        table = (
            markdown(rows, peak, flood, rss)
            + "\n".join(stats_lines)
            + "\n"
            + (
                f"\nLoad average at the start {load_start:.1f}, at the end {os.getloadavg()[0]:.1f} (2-core machines are shared: "
                f"compare classes within one run).\n"
            )
        )
        print(table)
        report.write(
            out,
            table,
            {
                "peak": peak,
                "rows": rows,
                "flood": flood,
                "rss": rss,
                "rss_samples": rss_samples,
                "per_model_overload": per_model,
                "args": vars(args) | {"out": str(out)},
                "variant": config_name,
            },
        )
        say(f"wrote {out}")
        inter = next(r for r in rows if r["phase"] == "overload" and r["class"] == "interactive")
        failures = []
        if inter["p99_ms"] is None or inter["p99_ms"] > CLASSES["interactive"].budget_ms:
            failures.append(f"interactive P99 {inter['p99_ms']} ms over its {CLASSES['interactive'].budget_ms} ms budget")
        if any(r["other_errors"] for r in rows):
            failures.append(
                "a probe got an error other than UNAVAILABLE: " + "; ".join(r["first_other"] for r in rows if r["other_errors"])
            )
        if any(flood[c]["other"] or flood[c]["socket_errors"] for c in ("default", "bulk")):
            failures.append("the flood got errors other than UNAVAILABLE, or dropped connections")
        for f in failures:
            say("FAIL: " + f)
        return 1 if failures else 0
    finally:
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
