"""Generation streams outlive their replica (issue 38 item 5): under serve-cluster (2 replicas,
text_generation on the variant PRECISION=auto serves, the gateway), the replica serving a stream
is SIGKILLed mid-answer; the gRPC door sends the request again to the other replica with the token
ids the client got as prefix_token_ids (server/stream_resume.py), and the client sees the rest of
the answer: no error, no token twice, the same text and token count as an uninterrupted run, for a
greedy and a seeded sampled request, through the project's gRPC client and through the gateway
with the official openai SDK, and over Triton's HTTP generate_stream through the front door (the
gRPC door's stream listener, server/stream_door.py). And a stream whose replica keeps running but loses its
text_generation stub (tritonserver 2.51 would leave it open) goes on the same way.

Each case runs its stream alone, as its reference did: the served variant (ov_int4_f16 on this kind
of CPU) computes a step of one or two rows on other weights than a larger one, so a stream's tokens
depend on what ran beside it, and only a continuation of a lone stream has one right answer. Each
case kills the replica that took its stream and waits for it to be back before the next one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from perf.lib.cluster import launch

KEY = "sk-test-cluster-streams-0123456789"
MISSING = [
    b
    for b in ("nginx", "redis-server")
    if shutil.which(b) is None and not Path(f"/usr/bin/{b}").exists() and not Path(f"/usr/sbin/{b}").exists()
]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)} (scripts/setup.sh)")

QUESTION = [{"role": "user", "content": "Describe a walk along the sea in a few sentences."}]
TOKENS = 48
KINDS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 1234}}
KILL_AFTER_PIECES = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run = launch(
        tmp_path_factory.mktemp("cluster-streams-"),
        replicas=2,
        models=("text_generation",),
        prometheus=False,
        env={"GATEWAY_API_KEYS": KEY, "GATEWAY_RATE_LIMIT_RPS": "0"},
    )
    try:
        yield run
    finally:
        run.stop(timeout=60)
        print("\n".join(run.screen[-15:]))


def _executions(cluster) -> list[int]:
    """Each replica's text_generation execution count (its own HTTP port)."""
    counts = []
    for r in cluster.state()["replicas"]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{r['http']}/v2/models/text_generation/stats", timeout=5) as f:
                stats = json.load(f)["model_stats"]
            counts.append(sum(int(s["execution_count"]) for s in stats))
        except OSError:
            counts.append(-1)
    return counts


def _resumed(cluster) -> int:
    log = Path(cluster.state()["front_door"]["log"]).parent / "grpc-door.log"
    return log.read_text(encoding="utf-8", errors="replace").count("continued on a new call")


def _answers_one_token(http_port: int) -> bool:
    """The replica's own text_generation streams a token: its stub is alive (tritonserver's ready
    endpoint says ready with a dead stub until the watchdog has reloaded the model)."""
    body = json.dumps({"text_input": "Hi", "sampling_parameters": json.dumps({"max_tokens": 1})}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v2/models/text_generation/generate_stream",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status == 200 and b'"error"' not in r.read()
    except OSError:
        return False


def _wait_all_ready(cluster, timeout: float = 180.0) -> None:
    """Every replica ready and its text_generation answering (a stub killed by the case before is
    reloaded by then, wherever its stream went on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replicas = cluster.state()["replicas"]
        if all(r["state"] == "ready" for r in replicas) and all(_answers_one_token(r["http"]) for r in replicas):
            time.sleep(1.0)  # the front door's reload that lists it again
            return
        time.sleep(0.5)
    raise AssertionError(f"the replicas are not all back: {cluster.state()['replicas']}")


class Killer:
    """SIGKILLs the replica whose execution count grew since it was made (the one serving the
    stream) once the stream got KILL_AFTER_PIECES pieces: its tritonserver and stubs, or with
    ``stub`` only its text_generation stub (the replica's watchdog reloads the model)."""

    def __init__(self, cluster, stub: bool = False):
        self.cluster, self.before, self.stub = cluster, _executions(cluster), stub
        self.pieces = 0
        self.victim: int | None = None

    def piece(self) -> None:
        self.pieces += 1
        if self.victim is None and self.pieces >= KILL_AFTER_PIECES:
            grown = [after - before for before, after in zip(self.before, _executions(self.cluster))]
            self.victim = max(range(len(grown)), key=grown.__getitem__)
            pid = self.cluster.state()["replicas"][self.victim]["pid"]
            if self.stub:
                from server.stubs import find_stubs

                (stub,) = [s for s in find_stubs(pid) if s.model == "text_generation" and not s.zombie]
                os.kill(stub.pid, signal.SIGKILL)
            else:
                os.killpg(pid, signal.SIGKILL)


def _grpc_stream(cluster, kind: str, killer: Killer | None) -> tuple[str, int]:
    """The project's asyncio gRPC client (retries before the first piece only)."""
    from clients.generation import AsyncGenerationClient

    async def go():
        async with AsyncGenerationClient(cluster.grpc_url, protocol="grpc", timeout_s=60) as client:
            stream = client.chat_stream(QUESTION, max_tokens=TOKENS, ignore_eos=True, **KINDS[kind])
            async with stream:
                async for _ in stream:
                    if killer is not None:
                        killer.piece()
            return stream.result.text, stream.result.num_output_tokens

    return asyncio.run(go())


def _sdk_stream(cluster, kind: str, killer: Killer | None) -> tuple[str, int]:
    """The official openai SDK through the gateway, without its retries."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.ports['gateway']}/v1", api_key=KEY, max_retries=0, timeout=60)
    parts, usage = [], None
    try:
        stream = client.chat.completions.create(
            model="text_generation",
            messages=QUESTION,
            max_tokens=TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **KINDS[kind],
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                if killer is not None:
                    killer.piece()
    finally:
        client.close()
    return "".join(parts), usage


def _http_stream(cluster, kind: str, killer: Killer | None) -> tuple[str, int]:
    """Triton's HTTP generate_stream through the front door (nginx, then the gRPC door's stream
    listener), read with http.client: no retry at all."""
    import http.client

    host, port = cluster.http_url.rsplit(":", 1)
    body = {
        "text_input": json.dumps(QUESTION),
        "apply_chat_template": True,
        "stream": True,
        "sampling_parameters": json.dumps({"max_tokens": TOKENS, "ignore_eos": True, **KINDS[kind]}),
        "return_num_output_tokens": True,
    }
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    parts, tokens = [], 0
    try:
        conn.request("POST", "/v2/models/text_generation/generate_stream", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, (response.status, response.read())
        for line in response:
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                assert "error" not in event and "token_ids" not in event, event
                parts.append(event.get("text_output", ""))
                tokens = event.get("num_output_tokens", tokens)
                if killer is not None and event.get("text_output"):
                    killer.piece()
    finally:
        conn.close()
    return "".join(parts), tokens


# A replica's restart (text_generation compiled and warmed up) takes most of a minute on 2 cores,
# and each case waits for it: make test-perf runs four cases (a stub, then the three paths);
# CLUSTER_STREAMS=all runs seven (every path with both kinds).
# The stub's death first: the replica stays up (its watchdog reloads the model), no restart to wait for.
CASES = [("grpc door", "greedy", "stub")] + [
    (p, k, "replica") for p in ("grpc door", "gateway", "http front door") for k in sorted(KINDS)
]
if os.environ.get("CLUSTER_STREAMS") != "all":
    CASES = [
        ("grpc door", "greedy", "stub"),
        ("grpc door", "greedy", "replica"),
        ("gateway", "seeded", "replica"),
        ("http front door", "greedy", "replica"),
    ]


@pytest.mark.parametrize("path,kind,what", CASES)
def test_a_stream_whose_replica_is_killed_mid_answer_goes_on_with_the_same_tokens(cluster, path, kind, what):
    run = {"grpc door": _grpc_stream, "gateway": _sdk_stream, "http front door": _http_stream}[path]
    _wait_all_ready(cluster)
    reference = run(cluster, kind, None)
    assert reference[1] == TOKENS and reference[0], reference
    resumed = _resumed(cluster)
    killer = Killer(cluster, stub=what == "stub")
    started = time.monotonic()
    got = run(cluster, kind, killer)  # a client error fails the test here
    print(
        f"{path}, {kind}: {what} of replica {killer.victim} killed after {KILL_AFTER_PIECES} pieces; {time.monotonic() - started:.1f} s"
    )
    assert killer.victim is not None and _resumed(cluster) > resumed
    assert got == reference, (got, reference)
