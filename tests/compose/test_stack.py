"""docker-compose's CPU profile, started by `make compose-test` (scripts/compose.sh test), checked from
the host on the ports it publishes on 127.0.0.1 only: the front door (HTTP, metrics), the gRPC door, the
gateway and Prometheus. Skipped unless scripts/compose.sh set COMPOSE_HTTP and the others.

Each check: embeddings over HTTP and gRPC against the PyTorch reference, the cached path, a photo
classified, a streamed chat through the openai SDK via the gateway, Prometheus with both replicas'
series and the alert rules, a stub SIGKILLed inside a replica (its probe port says so, then heals, no
request lost by a retrying client), an HTTP generation stream through both replicas' stubs killed
(continued, every token once), a replica's container killed under clients that never retry (0
failed, the replica back by its restart policy on the rollout's versions), a canary rollout and its
rollback by ops.rollout through the front door (the repository door acts on both replicas; clients that
never retry see no failure), and the hostile-request fuzz smoke against the doors (0 5xx, every replica
still answering). That `down -v` leaves nothing is checked by the script after.

The checks run in file order on one stack: the replica kill expects the canary's versions and the
rollback undoes the canary, so they are meant to run together (a `-k` subset, or a failed canary,
fails them for that reason).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

ENV = (
    "COMPOSE_HTTP",
    "COMPOSE_GRPC",
    "COMPOSE_GATEWAY",
    "COMPOSE_PROMETHEUS",
    "COMPOSE_METRICS",
    "COMPOSE_PROJECT_NAME",
    "COMPOSE_MODEL_REPOSITORY",  # the stack's repository: a copy the rollout publishes a version into
    "COMPOSE_ROLLOUT_STATE",  # the state file the replicas read at start (their .rollout/ mount)
    "GATEWAY_API_KEYS",
    "TRITON_REPOSITORY_TOKEN",
)
pytestmark = pytest.mark.skipif(
    not all(os.environ.get(v) for v in ENV), reason="docker-compose's stack is not up (make compose-test starts it)"
)
REPLICAS = ("triton-cpu-1", "triton-cpu-2")


def container(service: str) -> str:
    """The id of ``service``'s container in the project scripts/compose.sh started (by compose's own lookup)."""
    from server.layout import ROOT

    done = subprocess.run(
        ["docker-compose", "--profile", "cpu", "ps", "-q", service], capture_output=True, text=True, check=True, cwd=ROOT
    )
    (found,) = done.stdout.split()
    return found


def docker(*args: str, check: bool = True) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check).stdout.strip()


def probe(service: str, path: str = "/v2/health/ready") -> tuple[int, dict]:
    """The replica's probe port, from inside its container (it publishes no port)."""
    code = (
        "import json, sys, urllib.request, urllib.error\n"
        "try:\n"
        f"    r = urllib.request.urlopen('http://127.0.0.1:8003{path}', timeout=3); s, b = r.status, r.read()\n"
        "except urllib.error.HTTPError as e:\n"
        "    s, b = e.code, e.read()\n"
        "except OSError:\n"
        "    s, b = 0, b'{}'\n"
        "print(s); print(b.decode())\n"
    )
    out = docker("exec", container(service), "python", "-c", code, check=False).splitlines()
    return (int(out[0]), json.loads(out[1] or "{}")) if len(out) >= 2 else (0, {})


def wait_restarted_and_healthy(service: str, started_before: str, timeout: float = 300) -> float:
    """Seconds until the container has started again (another StartedAt) and its health check passed."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        state = docker("inspect", "-f", "{{.State.StartedAt}} {{.State.Health.Status}}", container(service), check=False)
        started, _, health = state.partition(" ")
        if started != started_before and health == "healthy":
            return time.monotonic() - start
        time.sleep(0.5)
    raise AssertionError(f"{service} not restarted and healthy after {timeout} s: {state}")


def served(service: str) -> tuple[list[int], str, str | None]:
    """(text_encoder's ready versions, text_embedding's form, the router's weights or None) of one
    replica, asked inside its container (it publishes no port)."""
    from python_backends.routing.ensemble import form_of

    code = (
        "import json, urllib.request, urllib.error\n"
        "def get(path):\n"
        "    try:\n"
        "        with urllib.request.urlopen('http://127.0.0.1:8000' + path, timeout=5) as r:\n"
        "            return r.status, json.loads(r.read() or b'{}')\n"
        "    except urllib.error.HTTPError as e:\n"
        "        return e.code, {}\n"
        "versions = [v for v in (1, 2) if get(f'/v2/models/text_encoder/versions/{v}/ready')[0] == 200]\n"
        "status, router = get('/v2/models/text_encoder_router/config')\n"
        "weights = router.get('parameters', {}).get('weights', {}).get('string_value') if status == 200 else None\n"
        "print(json.dumps({'versions': versions, 'embedding': get('/v2/models/text_embedding/config')[1], 'weights': weights}))\n"
    )
    answer = json.loads(docker("exec", container(service), "python", "-c", code))
    return answer["versions"], form_of(answer["embedding"], "text_encoder", "text_encoder_router"), answer["weights"]


def rollout(*args: str) -> subprocess.CompletedProcess:
    """`python -m ops.rollout` from the host, pointed at the front door as an operator runs it."""
    from server.layout import ROOT

    cmd = [
        sys.executable,
        "-m",
        "ops.rollout",
        "--url",
        os.environ["COMPOSE_HTTP"],
        "--token",
        os.environ["TRITON_REPOSITORY_TOKEN"],
    ]
    cmd += ["--metrics-url", f"http://{os.environ['COMPOSE_METRICS']}/metrics"]
    cmd += ["--state-file", os.environ["COMPOSE_ROLLOUT_STATE"], "--model-repository", os.environ["COMPOSE_MODEL_REPOSITORY"]]
    done = subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(f"$ rollout {' '.join(args)} -> {done.returncode}\n{done.stdout}{done.stderr}")
    return done


def embed_http(texts: list[str], model: str = "text_embedding") -> np.ndarray:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(os.environ["COMPOSE_HTTP"])
    data = np.array([[t] for t in texts], dtype=object)
    inp = httpclient.InferInput("TEXT", list(data.shape), "BYTES")
    inp.set_data_from_numpy(data)
    try:
        return client.infer(model, [inp]).as_numpy("EMBEDDING")
    finally:
        client.close()


def embed_grpc(texts: list[str]) -> np.ndarray:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(os.environ["COMPOSE_GRPC"])
    data = np.array([[t] for t in texts], dtype=object)
    inp = grpcclient.InferInput("TEXT", list(data.shape), "BYTES")
    inp.set_data_from_numpy(data)
    try:
        return client.infer("text_embedding", [inp]).as_numpy("EMBEDDING")
    finally:
        client.close()


TEXTS = ["docker-compose serves the same model", "un texte en français", "def f(x): return x * 2"]


def test_embeddings_over_http_and_grpc_match_the_reference():
    from export import reference

    expected = reference.embed(TEXTS)
    for label, got in (("http", embed_http(TEXTS)), ("grpc", embed_grpc(TEXTS))):
        cos = reference.cosine_rows(got, expected)
        print(f"{label}: min cosine {cos.min():.5f} against the PyTorch reference (the served variant: auto)")
        assert got.shape == (3, 384) and cos.min() > 0.99, (label, cos)


def test_the_cached_path_answers_the_same_vector_twice():
    first = embed_http(TEXTS[:1], model="text_embedding_cached")
    second = embed_http(TEXTS[:1], model="text_embedding_cached")
    direct = embed_http(TEXTS[:1])
    assert np.array_equal(first, second) and float(np.dot(first[0], direct[0])) > 0.9999


def test_a_photo_is_classified():
    import tritonclient.http as httpclient

    from export import image_data

    buf = io.BytesIO()
    image_data.load_photo("coffee.png").save(buf, format="JPEG", quality=90)
    client = httpclient.InferenceServerClient(os.environ["COMPOSE_HTTP"])
    inp = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[buf.getvalue()]], dtype=object))
    try:
        result = client.infer("image_classification", [inp])
    finally:
        client.close()
    top5 = result.as_numpy("CLASS_INDEX")[0].tolist()
    assert top5[0] in {967, 968, 504}, top5  # espresso, cup, coffee mug


def test_a_streamed_chat_through_the_gateway_with_the_openai_sdk():
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{os.environ['COMPOSE_GATEWAY']}/v1", api_key=os.environ["GATEWAY_API_KEYS"].split(",")[0])
    stream = client.chat.completions.create(
        model="text_generation",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    text = "".join(pieces)
    print(f"streamed in {len(pieces)} chunks: {text!r}")
    assert len(pieces) > 3 and "Paris" in text


def prometheus(path: str) -> dict:
    with urllib.request.urlopen(f"http://{os.environ['COMPOSE_PROMETHEUS']}{path}", timeout=10) as r:
        return json.loads(r.read())


def test_prometheus_scrapes_both_replicas_and_loads_the_rules():
    deadline = time.monotonic() + 60
    while True:
        result = prometheus("/api/v1/query?query=nv_inference_count")["data"]["result"]
        instances = {r["metric"]["instance"] for r in result}
        if len(instances) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert instances == {"triton-upstream-1:8002", "triton-upstream-2:8002"}, instances
    up = {r["metric"]["instance"]: r["value"][1] for r in prometheus("/api/v1/query?query=up")["data"]["result"]}
    assert all(v == "1" for v in up.values()) and len(up) >= 3, up  # both replicas and the gateway
    groups = prometheus("/api/v1/rules")["data"]["groups"]
    alerts = [r["name"] for g in groups for r in g["rules"] if r["type"] == "alerting"]
    assert alerts, groups
    print(f"{len(groups)} rule groups, alerts: {', '.join(alerts)}")


def front_door_ready() -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{os.environ['COMPOSE_HTTP']}/v2/health/ready", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_the_front_doors_readiness_is_the_replicas_probe_ports():
    status, body = front_door_ready()
    assert status == 200 and body["replicas"] == {"triton-upstream-1": 200, "triton-upstream-2": 200}, body


def test_a_stub_killed_inside_a_replica_is_seen_by_its_probe_and_healed():
    service = REPLICAS[0]
    assert probe(service)[0] == 200
    assert kill_stub(service, "text_encoder"), "no text_encoder stub in the replica"
    start = time.monotonic()
    seen_down = healed = None
    lost = 0
    while time.monotonic() - start < 45:
        status, body = probe(service)
        if status == 503 and seen_down is None:
            seen_down = time.monotonic() - start
            assert "text_encoder" in body.get("unhealthy", []), body
            # the front door stays ready (replica 2 serves) and says which replica is not
            door_status, door_body = front_door_ready()
            assert door_status == 200 and door_body["replicas"]["triton-upstream-1"] == 503, door_body
        if status == 200 and seen_down is not None:
            healed = time.monotonic() - start
            break
        for _ in range(5):  # a retrying client: 5 tries, 0.2 s apart
            try:
                embed_http(TEXTS[:1])
                break
            except Exception:  # noqa: BLE001 - counted, then retried
                time.sleep(0.2)
        else:
            lost += 1
    print(f"stub SIGKILLed in {service}: probe 503 after {seen_down} s, 200 after {healed} s; lost {lost}")
    assert seen_down is not None and healed is not None and healed < 30
    assert lost == 0


def kill_stub(service: str, model: str) -> str:
    """SIGKILL ``model``'s python backend stub inside the replica's container; its pid, or "" when none."""
    kill = (
        "import os, signal\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
        "    except OSError:\n"
        "        continue\n"
        f"    if argv[0].endswith(b'triton_python_backend_stub') and b'/{model}/1/' in argv[1]:\n"
        "        os.kill(int(pid), signal.SIGKILL); print(pid); break\n"
    )
    return docker("exec", container(service), "python", "-c", kill)


def test_an_http_generation_stream_outlives_the_stubs_serving_it():
    """Triton's HTTP generate_stream through the front door: nginx sends it to the grpc-door service's
    stream listener. Both replicas' text_generation stubs are SIGKILLed mid-answer (whichever serves
    it); the listener reads the marks on their probe ports and sends the request again after the
    tokens already sent: the client, which never retries, reads every token and no error."""
    import http.client
    import threading

    host, port = os.environ["COMPOSE_HTTP"].rsplit(":", 1)
    body = {
        "text_input": "Tell me a long story about the sea.",
        "stream": True,
        "sampling_parameters": json.dumps({"max_tokens": 200, "temperature": 0, "ignore_eos": True}),
        "return_num_output_tokens": True,
        "return_token_ids": True,  # a token dropped or sent twice across the continuation shows in them
    }
    events: list[dict] = []
    started = threading.Event()

    def read() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        try:
            conn.request(
                "POST", "/v2/models/text_generation/generate_stream", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            assert response.status == 200, response.status
            for line in response:
                if line.startswith(b"data:"):
                    events.append(json.loads(line[5:]))
                    if len(events) == 3:
                        started.set()
        finally:
            started.set()
            conn.close()

    reader = threading.Thread(target=read, daemon=True)
    start = time.monotonic()
    reader.start()
    assert started.wait(120) and len(events) >= 3, events
    killed = [kill_stub(service, "text_generation") for service in REPLICAS]
    assert all(killed), killed
    reader.join(180)
    took = time.monotonic() - start
    errors = [e for e in events if "error" in e]
    print(f"HTTP stream with both text_generation stubs killed after 3 events: {len(events)} events in {took:.1f} s, {errors}")
    assert not errors and events[-1].get("num_output_tokens") == 200, events[-3:]
    ids = [t for e in events for t in (e["token_ids"] if isinstance(e.get("token_ids"), list) else [e.get("token_ids")])]
    assert len(ids) == 200 and None not in ids, len(ids)  # every token reached the client once
    deadline = time.monotonic() + 60
    while any(probe(service)[0] != 200 for service in REPLICAS):  # both healed before the next check
        assert time.monotonic() < deadline, [probe(service) for service in REPLICAS]
        time.sleep(1)


def test_a_canary_rollout_through_the_front_door_reaches_both_replicas_and_loses_nothing():
    from ops.rollout import publish
    from python_backends.routing.ensemble import DIRECT, ROUTED
    from tests.integration.plain_clients import PlainClients

    for service in REPLICAS:
        assert served(service)[:2] == ([1], DIRECT), service
    version = publish(Path(os.environ["COMPOSE_MODEL_REPOSITORY"]), link=True)  # version 1's files, hard-linked
    assert version == 2
    with PlainClients(os.environ["COMPOSE_HTTP"], os.environ["COMPOSE_GRPC"], http_threads=2, grpc_threads=1) as load:
        # what is checked here is that each step reaches both replicas; the judgement is
        # tests/integration/test_rollout.py's (on 2 busy cores a fresh version's P99 is noise)
        step = ["--steps", "50,100", "--dwell", "2", "--check-interval", "1", "--allow-unjudged"]
        done = rollout("start", "2", *step, "--p99-ratio", "20", "--p99-slack-ms", "5000")
        outcomes = load.take()
    assert done.returncode == 0 and "step 2 passed" in done.stdout, done.stdout + done.stderr
    for service in REPLICAS:  # both replicas: both versions, the router in front, all traffic on 2
        assert served(service) == ([1, 2], ROUTED, "1:0,2:100"), service
    print(f"requests during the rollout: {dict(outcomes)}")
    failed = {k: v for k, v in outcomes.items() if not k.endswith("OK") and not k.endswith("200")}
    assert not failed and sum(outcomes.values()) > 20, outcomes


def test_a_replica_container_killed_under_clients_that_never_retry_loses_nothing():
    """One kill of replica 2 (COMPOSE_REPLICA_KILLS=N: N kills, the replicas in turn, each once the
    other is healthy), under the same clients throughout."""
    from python_backends.routing.ensemble import ROUTED
    from tests.integration.plain_clients import PlainClients

    kills = int(os.environ.get("COMPOSE_REPLICA_KILLS") or 1)
    backs = []
    with PlainClients(os.environ["COMPOSE_HTTP"], os.environ["COMPOSE_GRPC"], http_threads=4, grpc_threads=2) as load:
        time.sleep(3)
        for kill in range(kills):
            service = REPLICAS[1 - kill % 2]
            pid, started = docker("inspect", "-f", "{{.State.Pid}} {{.State.StartedAt}}", container(service)).split()
            restarts = int(docker("inspect", "-f", "{{.RestartCount}}", container(service)))
            subprocess.run(["kill", "-9", pid], check=True)  # the container's init, from the host: a crash
            backs.append(wait_restarted_and_healthy(service, started, timeout=240))
            assert int(docker("inspect", "-f", "{{.RestartCount}}", container(service))) == restarts + 1
            # back on the cluster's versions: the rollout state it mounts (not the newest folder alone)
            assert served(service) == ([1, 2], ROUTED, "1:0,2:100")
            time.sleep(3)
        outcomes = load.take()
    print(f"{kills} replica kill(s), back healthy after {', '.join(f'{b:.1f}' for b in backs)} s: {dict(outcomes)}")
    failed = {k: v for k, v in outcomes.items() if not k.endswith("OK") and not k.endswith("200")}
    assert not failed and sum(outcomes.values()) > 100, outcomes


def test_the_rollback_through_the_front_door_reaches_both_replicas():
    from ops.rollout import RolloutState
    from python_backends.routing.ensemble import DIRECT

    done = rollout("rollback")
    assert done.returncode == 0, done.stdout + done.stderr
    for service in REPLICAS:
        assert served(service)[:2] == ([1], DIRECT), service
    assert RolloutState.load(Path(os.environ["COMPOSE_ROLLOUT_STATE"])).phase == "rolled_back"


def test_the_fuzz_smoke_against_the_doors_finds_no_5xx_and_every_replica_answers():
    from tests.fuzz import endpoints as fuzz

    http_url, grpc_url = os.environ["COMPOSE_HTTP"], os.environ["COMPOSE_GRPC"]
    models = fuzz.served_models(http_url, ["text_embedding", "image_classification"])
    tally = fuzz.Tally()
    fuzz.run_endpoint_fuzz(http_url, grpc_url, models, 300, 17, print, tally)
    print(fuzz.table(tally))
    assert tally.total() >= 300 and not tally.bad(), (tally.bad(), tally.findings[:5])
    for service in REPLICAS:
        assert probe(service)[0] == 200, service
    for _ in range(4):  # round-robin: both replicas answer
        assert embed_http(TEXTS[:1]).shape == (1, 384)
