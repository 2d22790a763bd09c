"""One version across serve-cluster: a rollout and a rollback through the front door act on
every replica, the repository API through the front door reaches every replica, and a replica
restarted after a rollout comes back on the version the cluster serves, all under a load of
clients that never retry.

`python -m server.cluster` with 2 replicas serving text_embedding (INT8) from a copy of the
model repository where text_encoder version 2 is version 1 with its output negated
(tests/integration/versions.py): every answer tells which version computed it. Keep-alive
http.client threads and tritonclient gRPC threads (no retries) send one text throughout; each
answer is counted by the version that computed it.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ops.repository import GRPC_TOKEN_HEADER, TOKEN_HEADER, RepositoryClient, http
from ops.rollout import RolloutState
from perf.lib.cluster import launch
from python_backends.routing.ensemble import DIRECT, ROUTED, form_of
from server.layout import ROOT
from tests.integration.plain_clients import PlainClients
from tests.integration.versions import versioned_repository

MISSING = [
    b
    for b in ("nginx", "redis-server")
    if shutil.which(b) is None and not Path(f"/usr/bin/{b}").exists() and not Path(f"/usr/sbin/{b}").exists()
]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)} (scripts/setup.sh)")

TEXT = "one version across the cluster"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("cluster-rollout-")
    repo = versioned_repository(work / "model_repository")
    state = work / "rollout-state.json"
    # Without a state, Triton would load only the newest folder (2); the state pins version 1.
    RolloutState(stable=1, weights={1: 100}, loaded=[1]).save(state)
    run = launch(
        work,
        replicas=2,
        models=("text_embedding",),
        gateway=False,
        prometheus=False,
        rollout_state=state,
        extra=["--model-repository", str(repo), "--precision", "int8"],
    )
    run.repo, run.state_path = repo, state
    run.token = (work / "repository-token").read_text().strip()
    try:
        yield run
    finally:
        run.stop(timeout=60)
        print("\n".join(run.screen[-15:]))


def _replicas(cluster) -> list[RepositoryClient]:
    return [RepositoryClient(f"127.0.0.1:{r['http']}", token=cluster.token) for r in cluster.state()["replicas"]]


def _embedding(url: str) -> np.ndarray:
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [TEXT]}]}
    status, raw = http(f"http://{url}/v2/models/text_embedding/infer", "POST", body, timeout=30)
    assert status == 200, raw
    outputs = {o["name"]: o["data"] for o in json.loads(raw)["outputs"]}
    return np.asarray(outputs["EMBEDDING"], dtype=np.float32)


class VersionedLoad(PlainClients):
    """Plain clients (no retries, tests/integration/plain_clients.py) whose answers are counted
    by the version whose vector they are (version 2 is version 1 negated); anything else by what
    it was."""

    def __init__(self, cluster, reference: np.ndarray, http_threads: int = 4, grpc_threads: int = 2):
        super().__init__(cluster.http_url, cluster.grpc_url, http_threads, grpc_threads, text=TEXT)
        self.reference = reference

    def _version(self, vector: np.ndarray) -> str:
        vector = np.asarray(vector, dtype=np.float32).reshape(-1)
        if np.abs(vector - self.reference).max() < 1e-3:
            return "version 1"
        if np.abs(vector + self.reference).max() < 1e-3:
            return "version 2"
        return "neither version"

    def http_outcome(self, status: int, raw: bytes) -> str:
        if status != 200:
            return f"http {status} {raw[:120]!r}"
        outputs = {o["name"]: o["data"] for o in json.loads(raw)["outputs"]}
        return f"http {self._version(outputs['EMBEDDING'])}"

    def grpc_outcome(self, result) -> str:
        return f"grpc {self._version(result.as_numpy('EMBEDDING'))}"

    def grpc_error(self, exc) -> str:
        return f"grpc {exc.status()} {exc.message()[:120]}"


def _rollout(cluster, *args: str) -> subprocess.CompletedProcess:
    """`python -m ops.rollout` pointed at the front door, as an operator runs it."""
    cmd = [
        sys.executable,
        "-m",
        "ops.rollout",
        "--url",
        cluster.http_url,
        "--token",
        cluster.token,
        "--state-file",
        str(cluster.state_path),
        "--model-repository",
        str(cluster.repo),
        *args,
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    print(f"$ rollout {' '.join(args)} -> {done.returncode}\n{done.stdout}{done.stderr}")
    return done


def _served(replica: RepositoryClient) -> tuple[list[int], str]:
    """(text_encoder's ready versions, text_embedding's form) of one replica. (Not the config's
    version policy: a version kept across a reload keeps the config it was loaded with.)"""
    versions = [v for v in (1, 2) if replica.ready("text_encoder", v)]
    return versions, form_of(replica.config("text_embedding"), "text_encoder", "text_encoder_router")


def _only(outcomes: collections.Counter, *versions: str) -> None:
    allowed = {f"{p} {v}" for p in ("http", "grpc") for v in versions}
    assert set(outcomes) <= allowed, dict(outcomes)
    assert sum(outcomes.values()) > 50, dict(outcomes)


def test_the_repository_api_through_the_front_door_acts_on_every_replica(cluster):
    base = f"http://{cluster.http_url}"
    path = "/v2/repository/models/text_encoder_router/load"
    status, raw = http(base + path, "POST", {})
    assert status == 401 and TOKEN_HEADER.encode() in raw  # the door refuses without the token
    status, raw = http(base + "/v2/cluster/replicas")
    assert status == 401  # where the replicas are is not public
    status, raw = http(base + "/v2/cluster/replicas", headers={TOKEN_HEADER: cluster.token})
    assert status == 200 and len(json.loads(raw)["replicas"]) == 2
    replicas = _replicas(cluster)
    assert not any(r.ready("text_encoder_router") for r in replicas)
    status, raw = http(base + path, "POST", {}, headers={TOKEN_HEADER: cluster.token})
    assert status == 200, raw
    assert all(r.ready("text_encoder_router") for r in replicas)
    # A load every replica refuses (weights that do not sum to 100): refused once, naming the
    # replica and the field; the router the replicas serve stays as it was.
    config = replicas[0].config("text_encoder_router")
    config["parameters"]["weights"] = {"string_value": "1:90,2:20"}
    status, raw = http(base + path, "POST", {"parameters": {"config": json.dumps(config)}}, headers={TOKEN_HEADER: cluster.token})
    assert status == 400 and b"replica 0" in raw and b"weights sum to 110" in raw, raw
    assert all(r.ready("text_encoder_router") for r in replicas)
    assert all(_served(r) == ([1], DIRECT) for r in replicas)
    status, raw = http(
        base + "/v2/repository/models/text_encoder_router/unload", "POST", {}, headers={TOKEN_HEADER: cluster.token}
    )
    assert status == 200, raw
    deadline = time.monotonic() + 30
    while any(r.ready("text_encoder_router") for r in replicas) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(r.ready("text_encoder_router") for r in replicas)
    # Over gRPC a load would reach one replica through nginx: the gRPC door refuses it, naming the way.
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(cluster.grpc_url)
    with pytest.raises(grpcclient.InferenceServerException) as refused:
        client.load_model("text_encoder_router", headers={GRPC_TOKEN_HEADER: cluster.token})
    assert refused.value.status() == "StatusCode.FAILED_PRECONDITION" and "/v2/repository/" in refused.value.message()
    assert client.get_model_repository_index(headers={GRPC_TOKEN_HEADER: cluster.token}).models  # others pass
    client.close()
    assert not any(r.ready("text_encoder_router") for r in replicas)


def test_a_rollout_and_a_rollback_act_on_every_replica_under_load_with_no_failed_request(cluster):
    replicas = _replicas(cluster)
    reference = _embedding(cluster.http_url)
    for r in replicas:
        assert np.abs(_embedding(r.base.split("://")[1]) - reference).max() < 1e-3
    step = ["--steps", "50,100", "--dwell", "4", "--check-interval", "1", "--min-requests", "10", "--traffic-timeout", "30"]
    with VersionedLoad(cluster, reference) as load:
        time.sleep(3)
        _only(load.take(), "version 1")
        done = _rollout(cluster, "start", "2", *step)
        assert done.returncode == 0 and "a cluster of 2 replicas" in done.stdout
        assert "step 2 passed" in done.stdout
        during = load.take()
        # every replica: both versions loaded, the router in front with all traffic on 2
        for r in replicas:
            assert _served(r) == ([1, 2], ROUTED)
            weights = r.config("text_encoder_router")["parameters"]["weights"]["string_value"]
            assert weights == "1:0,2:100"
        time.sleep(3)
        _only(load.take(), "version 2")
        done = _rollout(cluster, "rollback")
        assert done.returncode == 0, done.stderr
        rolled_back = load.take()
        time.sleep(3)
        after = load.take()
    print(f"during the rollout: {dict(during)}\nduring the rollback: {dict(rolled_back)}\nafter: {dict(after)}")
    for outcomes in (during, rolled_back):
        _only(outcomes, "version 1", "version 2")
    _only(after, "version 1")
    for r in replicas:
        assert _served(r) == ([1], DIRECT)
        assert np.abs(_embedding(r.base.split("://")[1]) - reference).max() < 1e-3
    assert RolloutState.load(cluster.state_path).phase == "rolled_back"


def test_a_replica_restarted_after_the_rollout_comes_back_on_the_clusters_version(cluster):
    """Runs after the rollback above: the state says version 1 alone, while the newest folder is 2
    (what a replica would load without the state)."""
    assert RolloutState.load(cluster.state_path).loaded == [1]
    victim = cluster.state()["replicas"][1]
    reference = _embedding(cluster.http_url)
    with VersionedLoad(cluster, reference) as load:
        time.sleep(2)
        os.killpg(victim["pid"], signal.SIGKILL)  # tritonserver and its stubs (their own process group)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            now = cluster.state()["replicas"][1]
            if now["restarts"] >= 1 and now["state"] == "ready":
                break
            time.sleep(0.5)
        assert now["restarts"] >= 1 and now["state"] == "ready", now
        time.sleep(3)
        outcomes = load.take()
    print(f"replica 1 SIGKILLed and restarted: {dict(outcomes)}")
    _only(outcomes, "version 1")  # not one failed request, not one answer of version 2
    restarted = RepositoryClient(f"127.0.0.1:{now['http']}", token=cluster.token)
    assert _served(restarted) == ([1], DIRECT)
    assert np.abs(_embedding(f"127.0.0.1:{now['http']}") - reference).max() < 1e-3
