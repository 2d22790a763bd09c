"""Canary rollout against a real tritonserver (issues 6 and 13): the restricted repository API,
the router put in front of text_encoder for a rollout and taken out after it, full rollouts
1 -> 2 with a rollback and with a finish, under load on text_embedding and
text_embedding_cached at concurrency 16 with zero failed requests and every answer checked
against the version that served it, the automatic abort of a broken version 3, and a restart
that comes back with the last weights.

One server for the module, on a copy of the model repository (version folders are symlinks to
the exported files) with the INT8 variant. Version 2 is the INT8 model with its output negated:
a unit vector like version 1's, told apart by its sign, so an answer (or a cache entry) of the
wrong version is seen. Version 3 is the INT8 model with a truncated vocabulary: a Gather over a
5,000-row table in front of the output, so it loads, passes its warmup and the smoke check
(common word pieces only), and fails every request holding a rarer word piece - the kind of
broken export only real traffic reveals.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from ops.repository import GRPC_TOKEN_HEADER, TOKEN_HEADER, RepositoryClient, http
from ops.rollout import Rollout, RolloutState, Thresholds
from python_backends.routing.ensemble import DIRECT, ROUTED, form_of
from tests.integration.versions import versioned_repository

TOKEN = "rollout-test-token"
CONCURRENCY = 16  # half on text_embedding, half on text_embedding_cached
# Version 2's steps: long enough for a step to see its min_requests calls and its split row 100
# requests here. Version 3 is aborted at a check inside its first step (every second), which its
# dwell bounds (asserted below) and which never waits it out.
DWELL_S = 4.0
BROKEN_DWELL_S = 6.0
# Answers each entry point gets in one form (one version loaded, direct) before the next command:
# the direct periods' checks below need more than 50 per version, and each version has two.
ANSWERS_PER_PERIOD = 60
# |observed share of a version - its weight| per step, in percentage points. Requests are
# routed by a hash of their id (unique per request), so a step of N requests has a binomial
# standard deviation of at most 50/sqrt(N) points: about 2 points at N = 600.
SPLIT_TOLERANCE = 5.0
# Common word pieces only (ids < 5,000) and texts with rarer ones (version 3 fails those).
COMMON = [
    "A man is playing a guitar.",
    "A woman is reading a book in the park.",
    "The children are playing in the garden.",
    "She opened the window to let in fresh air.",
]
RARE = [
    "Photosynthesis converts sunlight into chemical energy.",
    "The archaeologist catalogued ceramic fragments.",
    "Cryptocurrency volatility unsettled investors.",
    "A kaleidoscope of turquoise and crimson hues.",
]


@pytest.fixture(scope="module")
def rollout_repo(tmp_path_factory):
    return versioned_repository(tmp_path_factory.mktemp("rollout") / "model_repository", broken_version=True)


@pytest.fixture(scope="module")
def rollout_server(start_triton, rollout_repo):
    state = rollout_repo.parent / "rollout-state.json"
    # Without a state, Triton would load only the newest folder (the broken 3); the launcher
    # applies the state: version 1 alone, all traffic on it, text_embedding in its direct form.
    RolloutState(stable=1, weights={1: 100}, loaded=[1]).save(state)
    with start_triton(
        "triton-rollout-",
        ("text_embedding", "text_embedding_cached", "text_embedding_cached_interactive"),
        model_repository=rollout_repo,
        model_config_name="int8",
        repository_token=TOKEN,
        rollout_state=state,
    ) as server:
        yield server, state


@pytest.fixture(scope="module")
def admin(rollout_server):
    server, _ = rollout_server
    return RepositoryClient(server.http_url, token=TOKEN, metrics_url=server.metrics_url)


def _rollout(admin, state_path, said, repo):
    return Rollout(admin, state_path, say=said.append, repository=repo, config_name="int8")


def test_server_started_from_the_state_file_in_the_direct_form(rollout_server, admin):
    assert admin.ready("text_encoder", 1)
    assert not admin.ready("text_encoder", 2) and not admin.ready("text_encoder", 3)
    assert admin.config("text_encoder")["version_policy"] == {"specific": {"versions": ["1"]}} or admin.config("text_encoder")[
        "version_policy"
    ] == {"specific": {"versions": [1]}}
    entry = admin.config("text_embedding")
    assert form_of(entry) == DIRECT and [o["name"] for o in entry["output"]] == ["EMBEDDING", "NUM_TOKENS"]
    assert not admin.ready("text_encoder_router")  # off the request path, not loaded


def test_repository_api_needs_the_token_and_inference_does_not(rollout_server, admin):
    server, _ = rollout_server
    url = f"http://{server.http_url}/v2/repository/models/text_tokenizer/load"
    status, body = http(url, "POST", {})
    assert status == 403 and TOKEN_HEADER in body.decode()
    assert http(url, "POST", {}, headers={TOKEN_HEADER: "wrong"})[0] == 403
    assert http(f"http://{server.http_url}/v2/repository/index", "POST", {})[0] == 403
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match=TOKEN_HEADER):
            grpc.load_model("text_tokenizer")
        with pytest.raises(InferenceServerException, match=GRPC_TOKEN_HEADER):
            grpc.load_model("text_tokenizer", headers={TOKEN_HEADER: TOKEN})  # the HTTP name is not enough
        grpc.load_model("text_tokenizer", headers={GRPC_TOKEN_HEADER: TOKEN})
        # Inference, health and statistics stay open.
        inp = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[b"still open"]], dtype=object))
        assert grpc.infer("text_embedding", [inp]).as_numpy("EMBEDDING").shape == (1, 384)
        assert grpc.is_server_ready()
    finally:
        grpc.close()
    assert http(url, "POST", {}, headers={TOKEN_HEADER: TOKEN})[0] == 200
    assert admin.version_stats("text_encoder")[1]["success"] >= 1


def test_steady_state_has_no_version_output_and_does_not_read_the_routing_parameters(rollout_server):
    server, _ = rollout_server
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        inp = httpclient.InferInput("TEXT", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[b"pinned"]], dtype=object))
        plain = client.infer("text_embedding", [inp])
        assert plain.as_numpy("ENCODER_VERSION") is None and plain.as_numpy("EMBEDDING").shape == (1, 384)
        with pytest.raises(InferenceServerException, match="ENCODER_VERSION"):
            client.infer("text_embedding", [inp], outputs=[httpclient.InferRequestedOutput("ENCODER_VERSION")])
        # One version serves: a pin or a routing key is not read (docs/versions-and-rollout.md).
        pinned = client.infer("text_embedding", [inp], parameters={"encoder_version": 9, "routing_key": "u1"})
        assert np.abs(pinned.as_numpy("EMBEDDING") - plain.as_numpy("EMBEDDING")).max() < 1e-5
        assert client.get_model_metadata("text_encoder")["versions"] == ["1"]  # where the version is read
    finally:
        client.close()


class Load:
    """CONCURRENCY asyncio workers over gRPC in a thread, half on text_embedding (all outputs:
    ENCODER_VERSION when the router is in front) and half on text_embedding_cached, on a few
    texts (the cache answers most), recording every response: (model, sent at, reported
    version, the version the vector is from, error)."""

    def __init__(self, url: str, references: dict[str, np.ndarray]):
        self.url = url
        self.references = references  # text -> version 1's vector
        self.records: list[tuple[str, float, int | None, int | None, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def vector_version(self, text: str, vector: np.ndarray) -> int | None:
        """1 (versions 1 and 3 compute the same vectors) or 2 (negated), by cosine."""
        cosine = float(vector.reshape(-1) @ self.references[text])
        return 1 if cosine > 0.99 else 2 if cosine < -0.99 else None

    async def _run(self):
        client = grpcaio.InferenceServerClient(self.url)
        texts = list(self.references)

        async def worker(w: int):
            model = "text_embedding" if w % 2 == 0 else "text_embedding_cached"
            n = 0
            while not self.stop.is_set():
                n += 1
                text = texts[(w * 7 + n) % len(texts)]
                inp = grpcaio.InferInput("TEXT", [1, 1], "BYTES")
                inp.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
                sent = time.time()
                try:
                    result = await client.infer(model, [inp], request_id=f"w{w}-{n}")
                    vector = result.as_numpy("EMBEDDING")
                    assert vector.shape == (1, 384) and abs(float(np.linalg.norm(vector)) - 1) < 1e-3
                    reported = result.as_numpy("ENCODER_VERSION")
                    self.records.append(
                        (model, sent, None if reported is None else int(reported[0, 0]), self.vector_version(text, vector), "")
                    )
                except Exception as exc:  # recorded: the test asserts there are none
                    self.records.append((model, sent, None, None, f"{type(exc).__name__}: {exc}"))

        try:
            await asyncio.gather(*(worker(w) for w in range(CONCURRENCY)))
        finally:
            await client.close()

    def answered(self, n: int = ANSWERS_PER_PERIOD, margin: float = 0.5, timeout: float = 60.0) -> None:
        """Wait until each entry point has ``n`` answers sent from ``margin`` seconds on (the
        margin the direct periods leave out after a switch): traffic in the form the last
        command left, whatever this machine's pace."""
        since, deadline = time.time() + margin, time.monotonic() + timeout
        start = len(self.records)
        counts: Counter = Counter()
        while time.monotonic() < deadline:
            counts = Counter(model for model, sent, _, _, error in self.records[start:] if sent >= since and not error)
            if len(counts) == 2 and min(counts.values()) >= n:
                return
            time.sleep(0.05)
        raise AssertionError(f"fewer than {n} answers per entry point in {timeout:.0f} s: {dict(counts)}")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=60)


def _references(url: str) -> dict[str, np.ndarray]:
    client = httpclient.InferenceServerClient(url)
    try:
        out = {}
        for text in COMMON + RARE:
            inp = httpclient.InferInput("TEXT", [1, 1], "BYTES")
            inp.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
            out[text] = client.infer("text_embedding", [inp]).as_numpy("EMBEDDING").reshape(-1)
        return out
    finally:
        client.close()


def _windows(history: list[dict], end: float) -> list[tuple[str, dict, float, float]]:
    """(event, weights, from, to) for every weight change recorded in the rollout history."""
    changes = [(e["event"], e["weights"], e["at"]) for e in history if "weights" in e]
    out = []
    for i, (event, weights, at) in enumerate(changes):
        until = changes[i + 1][2] if i + 1 < len(changes) else end
        out.append((event, dict((int(v), int(p)) for v, p in (x.split(":") for x in weights.split(","))), at, until))
    return out


def _direct_periods(history: list[dict], start: float, end: float) -> list[tuple[float, float, int]]:
    """(from, to, version) while text_embedding was in its direct form: from the start (version
    1) and from each "router out" until the next "router in front" began."""
    periods, since, version = [], start, 1
    for e in history:
        if e["event"] == "router in front" and since is not None:
            periods.append((since, e["at"], version))
            since = None
        elif e["event"] == "router out":
            since, version = e["at"], e["serving"]
    if since is not None:
        periods.append((since, end, version))
    return periods


def test_rollouts_rollback_finish_and_abort_under_load(rollout_server, admin, rollout_repo, capsys):
    """Start -> steps -> rollback, start -> steps -> finish, then a broken version's abort, all
    under load on both entry points: zero failed requests, each answer from a version that
    was serving, the router in front exactly while more than one version is loaded."""
    server, state_path = rollout_server
    said: list[str] = []
    rollout = _rollout(admin, state_path, said, rollout_repo)
    thresholds = Thresholds(max_error_rate=0.01, p99_ratio=3.0, p99_slack_ms=250.0, min_requests=20)
    references = _references(server.http_url)
    forms = []
    with Load(server.grpc_url, references) as load:
        t0 = time.time()
        load.answered()  # traffic on version 1 alone first
        assert rollout.start(2, [10, 50, 100], DWELL_S, thresholds, check_interval_s=1.0, window_s=900) == 0, said
        assert RolloutState.load(state_path).phase == "rolled_out"
        assert admin.ready("text_encoder", 1) and admin.ready("text_encoder", 2)  # 1 kept for rollback
        forms.append(form_of(admin.config("text_embedding")))
        load.answered()  # traffic on the rolled-out weights
        assert rollout.rollback() == 0
        assert not admin.ready("text_encoder", 2) and not admin.ready("text_encoder_router")
        forms.append(form_of(admin.config("text_embedding")))
        load.answered()  # traffic back on version 1 alone, direct
        assert rollout.start(2, [50, 100], DWELL_S, thresholds, check_interval_s=1.0, window_s=900) == 0, said
        # the interactive lane served the stable version all along (pinned at start) ...
        assert admin.ready("text_encoder_interactive", 1) and not admin.ready("text_encoder_interactive", 2)
        assert rollout.finish(force=True) == 0
        assert not admin.ready("text_encoder", 1) and not admin.ready("text_encoder_router")
        # ... and follows the finished rollout (docs/priority-classes.md)
        assert admin.ready("text_encoder_interactive", 2) and not admin.ready("text_encoder_interactive", 1)
        forms.append(form_of(admin.config("text_embedding")))
        load.answered()  # version 2 alone, direct: the cache answers with version 2's vectors only
        # 50 % at once: half the load is on the cache, so a 10 % step would see too few calls of 3 to be judged early.
        aborted = rollout.start(3, [50, 100], BROKEN_DWELL_S, thresholds, check_interval_s=1.0, window_s=900)
        forms.append(form_of(admin.config("text_embedding")))
        load.answered()  # version 2 alone again, direct
        time.sleep(0.5)  # past the margin the last direct period leaves out at its end
        end = time.time()
    state = RolloutState.load(state_path)
    records = load.records
    failed = [r for r in records if r[4]]

    # The split per step: text_embedding's answers sent after a weight change returned and
    # before the next one, by the version they report.
    rows = []
    for event, weights, start, until in _windows(state.history, end):
        served = Counter(v for model, sent, v, _, _ in records if start <= sent < until and v is not None)
        n = sum(served.values())
        observed = {v: round(100.0 * served[v] / n, 1) for v in sorted(set(served) | set(weights))} if n else {}
        rows.append({"event": event, "weights": weights, "requests": n, "observed_percent": observed})
    # In the direct form: every answer (text_embedding's and the cache's) from the one version
    # loaded. A request sent just before a switch may be answered by either form.
    periods = _direct_periods(state.history, t0, end)
    margin = 0.5
    direct = {"text_embedding": Counter(), "text_embedding_cached": Counter()}
    wrong = []
    for model, sent, reported, from_vector, error in records:
        if error:
            continue
        if reported is not None and from_vector != (2 if reported == 2 else 1):
            wrong.append(("reported", model, sent, reported, from_vector))
        for since, until, version in periods:
            if since + margin <= sent < until - margin:
                direct[model][from_vector] += 1
                if from_vector != version or reported is not None:
                    wrong.append(("direct", model, sent, reported, from_vector, version))
    by_model = Counter(model for model, *_ in records)
    report = {
        "requests_sent": dict(by_model),
        "failed": len(failed),
        "steps": rows,
        "direct_periods": [(round(a - t0, 1), round(b - t0, 1), v) for a, b, v in periods],
        "direct_answers_by_vector_version": {m: dict(c) for m, c in direct.items()},
        "failed_at_s": [(m, round(sent - t0, 1), e[:120]) for m, sent, _, _, e in failed[:10]],
        # What a switch takes: seconds from the event before (router load + ensemble reload,
        # or ensemble reload + router unload).
        "switch_s": [
            (e["event"], round(e["at"] - before["at"], 2))
            for before, e in zip(state.history, state.history[1:])
            if e["event"] in ("router in front", "router out")
        ],
        "wrong_version": len(wrong),
        "forms_after_each_command": forms,
        "abort": next((e for e in state.history if e["event"] == "aborted"), None),
    }
    with capsys.disabled():
        print("\nrollout under load:", json.dumps(report, indent=1, default=str))
        print("rollout command said:\n  " + "\n  ".join(said))

    assert not failed, failed[:5]
    assert not wrong, wrong[:5]
    assert min(by_model.values()) > 300, by_model
    assert forms == [ROUTED, DIRECT, DIRECT, DIRECT]
    # Both versions were seen in the direct form, on both entry points, cache answers included.
    for model, counts in direct.items():
        assert counts[1] > 50 and counts[2] > 50, (model, counts)
    assert [p[2] for p in periods] == [1, 1, 2, 2], periods
    assert aborted == 1 and state.phase == "aborted" and state.stable == 2 and state.weights == {2: 100}
    assert "error rate" in state.reason and "version 3" in state.reason
    assert not admin.ready("text_encoder", 3) and admin.ready("text_encoder", 2)
    assert not admin.ready("text_encoder_router")
    checked = 0
    for row in rows:
        # Version 3's step: its failed calls were answered by version 2 (router fallback), so
        # the split there is not the weights' (checked below instead).
        if row["requests"] < 100 or 3 in row["weights"]:
            continue
        for version, weight in row["weights"].items():
            assert abs(row["observed_percent"].get(version, 0.0) - weight) <= SPLIT_TOLERANCE, row
        checked += 1
    assert checked >= 5, rows  # 10 %, 50 %, 100 % twice and the rollback at least
    broken = next(r for r in rows if 3 in r["weights"])
    assert 0 < broken["observed_percent"].get(3, 0.0) < 50  # it served its common-word calls only

    # The router went in front before each new version was loaded, and out after.
    events = [e["event"] for e in state.history]
    starts = [i for i, e in enumerate(events) if e == "start"]
    assert len(starts) == 3
    for i in starts:
        assert events[i + 1] == "router in front", events[i : i + 3]
    assert events.count("router out") == 3
    # Every step of the first rollout of version 2 was judged on real traffic (enough calls,
    # none failed) after a whole dwell; version 3 was stopped by its error rate inside its
    # first step.
    v2, v3 = state.history[starts[0] : starts[1]], state.history[starts[2] :]
    passed = [e for e in v2 if e["event"].endswith(" passed")]
    assert [e["event"] for e in passed] == ["step 1 passed", "step 2 passed", "step 3 passed"], v2
    assert all(e["calls"] >= thresholds.min_requests and e["failed"] == 0 for e in passed), passed
    changes = [e["at"] for e in v2 if e["event"].startswith("step ") and "weights" in e]
    assert len(changes) == 3
    assert all(later - earlier >= DWELL_S for earlier, later in zip(changes, changes[1:])), changes
    step1 = next(e["at"] for e in v3 if e["event"].startswith("step 1:"))
    abort = next(e for e in v3 if e["event"] == "aborted")
    assert not any(e["event"].endswith(" passed") for e in v3), v3
    assert abort["calls"] >= thresholds.min_requests and abort["failed"] > 0, abort
    assert abort["at"] - step1 < BROKEN_DWELL_S, v3  # judged at a check within the step, not at its end


def test_pin_during_a_rollout_and_restart_comes_back_with_the_last_weights(rollout_server, admin):
    server, state_path = rollout_server
    state = RolloutState.load(state_path)
    state.stable, state.weights, state.loaded, state.phase = 1, {1: 30, 2: 70}, [1, 2], "canary"
    state.candidate, state.step, state.steps = 2, 1, [10, 70, 100]
    state.save(state_path)
    server.stop()
    server.start()
    server.wait_ready(timeout=300)
    router = admin.config("text_encoder_router")
    assert router["parameters"]["weights"]["string_value"] == "1:30,2:70"
    assert form_of(admin.config("text_embedding")) == ROUTED
    assert admin.ready("text_encoder", 1) and admin.ready("text_encoder", 2) and not admin.ready("text_encoder", 3)
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        inp = httpclient.InferInput("TEXT", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[b"after restart"]], dtype=object))
        served = Counter(
            int(client.infer("text_embedding", [inp], request_id=f"r{i}").as_numpy("ENCODER_VERSION")[0, 0]) for i in range(200)
        )
        # During a rollout the router reads the pin.
        assert client.infer("text_embedding", [inp], parameters={"encoder_version": 2}).as_numpy("ENCODER_VERSION").tolist() == [
            [2]
        ]
        with pytest.raises(InferenceServerException, match="encoder_version: version 9 is not served; versions: 1, 2, 3"):
            client.infer("text_embedding", [inp], parameters={"encoder_version": 9})
    finally:
        client.close()
    assert set(served) == {1, 2} and 120 <= served[2] <= 160, served  # 70 % of 200 = 140, +/- 20
