"""Fuzz every served model's endpoints and the Python steps' decoding functions; count outcomes.

Three parts, one run (``make fuzz``; docs/fuzzing.md):

1. **Endpoints, property-based (hypothesis).** For every model the server serves (the entry
   points and each ensemble step: all are reachable on the public ports), requests built from
   the model's own config (``GET /v2/models/<m>/config``) with mutations drawn on top: shapes
   (negative, zero, 2^32 + 1, 2^40, 2^63, wrong rank, not integers, mismatched with the data),
   datatypes (wrong, unknown, not a string), binary junk, huge / empty / odd-Unicode strings
   (lone surrogates, NUL, RTL marks, combining marks, 4-byte emoji), batch sizes that differ
   across inputs, missing, extra and renamed inputs, bogus request parameters (Triton's
   priority, timeout, sequence_*, binary_data_output; routing_key, encoder_version,
   priority_class; the generation model's sampling parameters), bogus outputs, and malformed
   bodies. Sent over HTTP JSON, HTTP binary-tensor extension, HTTP generate (decoupled
   models), gRPC typed contents, gRPC raw_input_contents and gRPC streaming, through the front
   door (the public ports).
2. **The OpenAI gateway**: the schemathesis fuzz of tests/integration/test_openai_gateway_hostile.py,
   run against a gateway in front of the same server; its counts join the table.
3. **Decoding functions, coverage-guided (atheris)**: tests/fuzz/targets.py, each target in
   its own process.

Oracles: every HTTP answer is a 2xx or a 4xx whose message names the field a mutation
touched (gRPC: OK or a client-error code, the same naming); zero 5xx (gRPC INTERNAL,
UNKNOWN, UNIMPLEMENTED, DATA_LOSS or a non-transport UNAVAILABLE); zero dropped connections
(no answer); zero crashed python stubs (the PIDs of tritonserver's children before and after)
and tritonserver alive; afterwards every model answers a known-good request exactly as it
did before the run. The counts per endpoint and outcome are printed and written to
perf/results/fuzz-<stamp>/ (counts.json, findings.json with the first failing cases).

    python -m tests.fuzz                         # 10,000 endpoint cases + gateway + atheris
    python -m tests.fuzz --cases 600 --gateway-examples 0 --atheris-runs 300
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from perf.lib.paths import ROOT
from perf.lib.report import progress, results_dir
from tests.fuzz.cases import GRPC_SERVER_ERRORS, ModelSpec, base_request
from tests.fuzz.encoding import encode_binary, encode_generate
from tests.fuzz.encoding import encode_json as encode_json
from tests.fuzz.sending import HTTP, Tally, run_endpoint_fuzz
from tests.fuzz.sending import classify_http as classify_http

# ---- the server's health: stub processes, liveness, known-good answers -------------------


def child_processes(pid: int) -> dict[int, str]:
    """{pid: command} of the processes whose parent is ``pid`` (the python backend stubs)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except (OSError, ValueError):
            continue
    return out


def known_good(http_url: str, model: ModelSpec) -> dict:
    """A valid request's answer: {output: list} (rounded), to compare before and after."""
    rng = np.random.default_rng(7)
    req = base_request(model, 1, 8, rng)
    for t in req.inputs:
        if t.values is not None and t.values.dtype == object and t.name not in ("IMAGE", "sampling_parameters"):
            t.values = np.full(t.values.shape, b"hello world", dtype=object)
    conn = HTTP(http_url)
    try:
        if model.decoupled:
            req.parameters = {"max_tokens": 4, "temperature": 0}
            answer = conn.post(f"/v2/models/{model.name}/generate", encode_generate(req))
        else:
            body, headers = encode_binary(req)  # JSON cannot carry an image's bytes
            answer = conn.post(f"/v2/models/{model.name}/infer", body, headers)
    finally:
        conn.close()
    if answer is None or answer[0] != 200:
        return {"error": answer and answer[1][:300].decode("utf-8", "replace")}
    data = json.loads(answer[1])
    if model.decoupled:
        return {"text_output": data.get("text_output")}
    return {
        o["name"]: np.round(np.asarray(o["data"], dtype=float if o["datatype"] != "BYTES" else object), 4).tolist()
        if o["datatype"] != "BYTES"
        else o["data"]
        for o in data.get("outputs", [])
    }


def same_answer(a: dict, b: dict) -> bool:
    if "error" in a or "error" in b or set(a) != set(b):
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, list) and x and not isinstance(np.asarray(x, dtype=object).reshape(-1)[0], str):
            if not np.allclose(np.asarray(x, float), np.asarray(y, float), atol=2e-3):
                return False
        elif x != y:
            return False
    return True


def served_models(http_url: str, names: Sequence[str]) -> list[ModelSpec]:
    import urllib.request

    out = []
    for name in names:
        try:
            with urllib.request.urlopen(f"http://{http_url}/v2/models/{name}/config", timeout=10) as r:
                out.append(ModelSpec.from_config(json.loads(r.read())))
        except OSError:
            continue
    return out


def repository_models(triton_http_url: str, token: str | None) -> list[str]:
    import urllib.request

    req = urllib.request.Request(
        f"http://{triton_http_url}/v2/repository/index",
        data=b"{}",
        method="POST",
        headers={"triton-repository-token": token or ""},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return sorted(m["name"] for m in json.loads(r.read()) if m.get("state") == "READY")


# ---- the gateway (the schemathesis fuzz of the hostile tests) ----------------------------


def gateway_fuzz(triton_grpc_url: str, examples: int, workdir: Path, say: Callable[[str], None], tally: Tally) -> None:
    """Run tests/integration/test_openai_gateway_hostile.py's schemathesis fuzz against a fresh
    gateway in front of this server; its counts go into ``tally`` as endpoint ``gateway``."""
    from server.gateway import GatewayOptions, GatewayProcess
    from server.process import free_port
    from tests.integration import test_openai_gateway_hostile as hostile
    from tests.integration.conftest import GATEWAY_TEST_KEY

    hostile.FUZZ_EXAMPLES = examples
    options = GatewayOptions(
        triton_grpc_url=triton_grpc_url,
        port=free_port(),
        workdir=workdir,
        api_key_file=workdir / "gateway-api-key",
        extra_args=["--rate-limit", "0", "--max-tokens-cap", "8", "--no-request-log"],
        env={"GATEWAY_API_KEYS": GATEWAY_TEST_KEY},
        drain_timeout=5,
    )
    gw = GatewayProcess(options).start()
    out = io.StringIO()
    started = time.monotonic()
    try:
        gw.wait_ready(timeout=60)
        failure = ""
        with contextlib.redirect_stdout(out):
            try:
                hostile.test_schemathesis_fuzz_of_the_openapi_schema_finds_no_5xx(gw)
            except AssertionError as exc:
                failure = str(exc)[:400]
    finally:
        gw.stop()
    text = out.getvalue()
    m = re.search(r"statuses (\{[^}]*\})", text)
    statuses = {int(k): int(v) for k, v in re.findall(r"(\d+): (\d+)", m.group(1))} if m else {}
    counts = tally.counts.setdefault("gateway (schemathesis)", Counter())
    for status, n in statuses.items():
        counts["2xx" if status < 300 else f"4xx:{status}" if status < 500 else f"5xx:{status}"] += n
        counts["cases"] += n
    if failure:
        tally.findings.append({"endpoint": "gateway (schemathesis)", "outcome": "failed", "detail": failure})
        counts["failed"] += 1
    say(
        f"  gateway (schemathesis) {counts['cases']:5} cases in {time.monotonic() - started:5.1f} s"
        + (f"; FAILED: {failure[:200]}" if failure else "")
    )


# ---- atheris ------------------------------------------------------------------------------

# tests/fuzz/targets.py's targets (not imported here: its import instruments python_backends).
ATHERIS_TARGETS = ("text", "image", "generation", "sampling", "routing", "shapes")


def atheris_fuzz(
    runs: int,
    workdir: Path,
    say: Callable[[str], None],
    tally: Tally,
    targets: Sequence[str] = ATHERIS_TARGETS,
    max_time: int = 300,
    parallel: int = 2,
) -> None:
    """Each target in its own process (``parallel`` at a time), ``runs`` runs or ``max_time`` s."""
    pending = list(targets)
    running: list[tuple[str, subprocess.Popen, float, Path]] = []
    while pending or running:
        while pending and len(running) < parallel:
            target = pending.pop(0)
            corpus = workdir / f"corpus-{target}"
            corpus.mkdir(parents=True, exist_ok=True)
            log_path = workdir / f"atheris-{target}.log"
            cmd = [
                sys.executable,
                "-m",
                "tests.fuzz.targets",
                target,
                f"-runs={runs}",
                "-len_control=0",
                "-max_len=4096",
                "-timeout=60",
                f"-max_total_time={max_time}",
                f"-artifact_prefix={workdir}/crash-{target}-",
                str(corpus),
            ]
            with log_path.open("w") as log_file:
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
            running.append((target, proc, time.monotonic(), log_path))
        for item in list(running):
            target, proc, started, log_path = item
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if time.monotonic() - started > max_time + 120:
                    proc.kill()
                    proc.wait()
                else:
                    continue
            running.remove(item)
            _count_atheris(target, proc.returncode, log_path.read_text(errors="replace"), time.monotonic() - started, say, tally)


def _count_atheris(target: str, code: int, log: str, took: float, say, tally: Tally) -> None:
    m = re.search(r"Done (\d+) runs", log)
    ran = int(m.group(1)) if m else 0
    cov = re.findall(r"cov: (\d+)", log)
    endpoint = f"atheris:{target}"
    counts = tally.counts.setdefault(endpoint, Counter())
    counts["cases"] += ran
    counts["ok"] += ran
    if code != 0:
        counts["crash"] += 1
        tail = log[log.find("Traceback") :][:1500] if "Traceback" in log else log[-1500:]
        tally.findings.append({"endpoint": endpoint, "outcome": "crash", "detail": tail})
    say(
        f"  atheris {target:14} {ran:6} runs in {took:5.1f} s, coverage {cov[-1] if cov else '?'}"
        + ("" if code == 0 else f"; CRASH (exit {code})")
    )


# ---- report -------------------------------------------------------------------------------


def table(tally: Tally) -> str:
    rows = [
        "| endpoint | cases | 2xx / OK | 4xx / client errors | 5xx / server errors | unnamed | dropped |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for endpoint, c in sorted(tally.counts.items()):
        ok = c["2xx"] + c["grpc:OK"] + c["ok"]
        client = {
            k: v
            for k, v in c.items()
            if k.startswith("4xx")
            or (k.startswith("grpc:") and k != "grpc:OK" and k.replace("grpc:", "") not in GRPC_SERVER_ERRORS | {"UNAVAILABLE"})
        }
        server = sum(
            v
            for k, v in c.items()
            if k.startswith("5xx") or k.replace("grpc:", "") in GRPC_SERVER_ERRORS | {"UNAVAILABLE"} or k in ("crash", "failed")
        )
        client_text = ", ".join(f"{k.replace('grpc:', '').replace('4xx:', '')} {v}" for k, v in sorted(client.items()))
        rows.append(f"| {endpoint} | {c['cases']} | {ok} | {client_text or '-'} | {server} | {c['unnamed']} | {c['dropped']} |")
    return "\n".join(rows)


@dataclass
class Health:
    alive: bool
    stubs_before: dict
    stubs_after: dict
    answers_ok: dict
    log_lines: list

    @property
    def crashed_stubs(self) -> list:
        return sorted(set(self.stubs_before) - set(self.stubs_after))


def run(args: argparse.Namespace) -> int:
    from perf.lib.deployment import server_deployment
    from server.process import ServerError

    started = time.monotonic()

    say = progress(started)

    out_dir = results_dir(args.out_dir, "fuzz")
    workdir = Path(tempfile.mkdtemp(prefix="fuzz-"))
    token = secrets.token_urlsafe(16)
    tally = Tally()
    deployment = server_deployment(args.models or (), workdir / "triton", repository_token=token)
    server = deployment
    say(f"tests.fuzz: starting tritonserver behind the front door ({', '.join(server.options.models)})")
    deployment.start()
    try:
        try:
            deployment.wait_ready(timeout=400)
        except ServerError as exc:
            say(f"{exc}\n{exc.log_tail}")
            return 1
        health = fuzz_server(
            server.http_url,
            server.grpc_url,
            server.process.pid,
            repository_models(server.triton_http_url, token),
            args,
            say,
            tally,
            log_path=server.log_path,
        )
        if args.gateway_examples > 0:
            gateway_fuzz(server.triton_grpc_url, args.gateway_examples, workdir / "gateway", say, tally)
        alive_after_all = server.process.poll() is None
    finally:
        deployment.stop()
    if args.atheris_runs > 0:
        atheris_fuzz(args.atheris_runs, workdir / "atheris", say, tally, max_time=args.atheris_max_time)
    return report(tally, health, alive_after_all, out_dir, args, say, time.monotonic() - started)


def fuzz_server(
    http_url: str, grpc_url: str, pid: int, model_names: Sequence[str], args, say, tally: Tally, log_path: Path | None = None
) -> Health:
    """The endpoint fuzz against a running server (front door at ``http_url``/``grpc_url``,
    tritonserver's ``pid``), with the health checks around it."""
    models = served_models(http_url, model_names)
    say(f"tests.fuzz: {len(models)} models reachable: {', '.join(m.name for m in models)}")
    before = {m.name: known_good(http_url, m) for m in models}
    stubs = child_processes(pid)
    log_start = log_path.stat().st_size if log_path and log_path.is_file() else 0
    run_endpoint_fuzz(http_url, grpc_url, models, args.cases, args.seed, say, tally)
    after = {m.name: known_good(http_url, m) for m in models}
    alive = Path(f"/proc/{pid}").exists()
    lines = []
    if log_path and log_path.is_file():
        with log_path.open("rb") as f:
            f.seek(log_start)
            lines = [
                ln
                for ln in f.read().decode("utf-8", "replace").splitlines()
                if re.search(r"segfault|Stub process .* not healthy|Signal \(|core dumped|bad_alloc", ln)
            ]
    return Health(
        alive,
        stubs,
        child_processes(pid),
        {m: same_answer(before[m], after[m]) and "error" not in before[m] for m in before},
        lines[:20],
    )


def report(tally: Tally, health: Health, alive_after_all: bool, out_dir: Path, args, say, took: float) -> int:
    bad = tally.bad()
    crashes = sum(c["crash"] for c in tally.counts.values())
    failed_gateway = sum(c["failed"] for c in tally.counts.values())
    summary = [
        "# Fuzz run",
        "",
        (
            f"- {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, {took:.0f} s; command: "
            f"`python -m tests.fuzz {' '.join(args.argv)}`"
        ),
        (
            f"- {tally.total()} cases in all; endpoint cases through the front door: "
            f"{sum(c['cases'] for k, c in tally.counts.items() if not k.startswith(('atheris', 'gateway')))}"
        ),
        (
            f"- server errors (5xx / gRPC INTERNAL, UNKNOWN, UNIMPLEMENTED, UNAVAILABLE): "
            f"{sum(v for k, v in bad.items() if k not in ('dropped', 'unnamed'))}; refusals not naming the field: "
            f"{bad['unnamed']}; dropped connections: {bad['dropped']} (kept-alive connections found closed "
            f"and sent again: {sum(c['reconnected'] for c in tally.counts.values())}); atheris crashes: {crashes}"
        ),
        (
            f"- python stubs before {len(health.stubs_before)}, crashed during the run "
            f"{len(health.crashed_stubs)}; tritonserver alive after the endpoint fuzz: {health.alive}, after the "
            f"gateway fuzz: {alive_after_all}; crash lines in its log: {len(health.log_lines)}"
        ),
        (f"- known-good answer unchanged after the run: {', '.join(f'{m} {ok}' for m, ok in sorted(health.answers_ok.items()))}"),
        "",
        table(tally),
        "",
    ]
    text = "\n".join(summary)
    (out_dir / "summary.md").write_text(text)
    (out_dir / "counts.json").write_text(json.dumps({k: dict(v) for k, v in tally.counts.items()}, indent=1))
    (out_dir / "findings.json").write_text(
        json.dumps(
            {"findings": tally.findings, "log": health.log_lines, "crashed_stubs": health.crashed_stubs}, indent=1, default=str
        )
    )
    print("\n" + text, flush=True)
    for f in tally.findings[:10]:
        print(f"  finding: {f['endpoint']} {f['outcome']}: {f['detail'][:300]}\n    {json.dumps(f.get('request'))[:400]}")
    say(f"tests.fuzz: results in {out_dir.relative_to(ROOT) if out_dir.is_relative_to(ROOT) else out_dir}")
    ok = (
        not bad
        and not crashes
        and not failed_gateway
        and health.alive
        and alive_after_all
        and not health.crashed_stubs
        and not health.log_lines
        and all(health.answers_ok.values())
    )
    return 0 if ok else 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.fuzz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cases", type=int, default=10_000, help="endpoint cases over all models (default 10000)")
    p.add_argument(
        "--gateway-examples",
        type=int,
        default=100,
        help="schemathesis examples per gateway operation and mode (0: skip the gateway)",
    )
    p.add_argument("--atheris-runs", type=int, default=2000, help="atheris runs per decoding target (0: skip)")
    p.add_argument("--atheris-max-time", type=int, default=120, help="seconds per atheris target at most")
    p.add_argument(
        "--models",
        type=lambda s: [m for m in s.split(",") if m],
        default=None,
        help="entry models to load (default: the launcher's; their steps are fuzzed too)",
    )
    p.add_argument("--seed", type=int, default=13, help="hypothesis seed (default 13)")
    p.add_argument("--out-dir", type=Path, default=None, help="default perf/results/fuzz-<UTC stamp>")
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
