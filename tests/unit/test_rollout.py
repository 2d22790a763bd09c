"""The rollout command's pure parts: state file, judging a step, publishing, the launcher's plan."""

import os
import stat
import time

import pytest

from contract.errors import ConfigError
from ops import repository
from ops.canary import judge
from ops.configs import config_from_disk
from ops.load_plan import load_plan
from ops.rollout import (
    RolloutState,
    Thresholds,
    UsageError,
    encoder_config,
    main,
    publish,
    router_config,
)
from python_backends.routing import RoutingError
from python_backends.routing.ensemble import DIRECT, ROUTED, direct_form, form_of, routed_form
from server.layout import ROOT
from server.models import closure, with_dependencies

REPO = ROOT / "model_repository"


def test_state_survives_a_restart_of_the_command(tmp_path):
    path = tmp_path / "s" / "state.json"
    state = RolloutState(stable=1, candidate=2, weights={1: 50, 2: 50}, loaded=[1, 2], phase="canary", step=1)
    state.event("step 2: 50 % to version 2")
    state.save(path)
    again = RolloutState.load(path)
    assert again == state and again.weights == {1: 50, 2: 50}
    assert not (tmp_path / "s" / "state.json.tmp").exists()
    plan = load_plan(path)
    assert plan.versions == (1, 2) and plan.weights == {1: 50, 2: 50}
    assert RolloutState.load(tmp_path / "missing.json") is None


def test_a_state_with_bad_weights_is_refused(tmp_path):
    path = tmp_path / "state.json"
    path.write_text('{"weights": {"1": 60, "2": 30}}')
    with pytest.raises(RoutingError, match="weights sum to 90"):
        RolloutState.load(path)


def test_judge_error_rate_and_p99():
    t = Thresholds(max_error_rate=0.01, p99_ratio=1.5, p99_slack_ms=20, min_requests=20)
    assert not judge(10, 5, 2, 10, 10, t, final=True).judged  # too few to judge
    bad = judge(90, 10, 2, 10.0, 10.0, t, final=False)
    assert not bad.ok and "error rate 10.0% (10 of 100) > 1.0%" in bad.reason
    assert judge(100, 0, 2, 10.0, 29.0, t, final=True).ok  # within +20 ms
    slow = judge(100, 0, 2, 10.0, 31.0, t, final=True)
    assert not slow.ok and "P99 31.0 ms > 30.0 ms" in slow.reason
    assert judge(100, 0, 2, 10.0, 31.0, t, final=False).ok  # P99 judged at the step's end
    assert judge(100, 1, 2, None, None, t, final=True).ok  # 1 % is the limit, not over it


def test_call_counters_per_series():
    from ops.canary import call_counts, calls_between

    def text(series):
        return "\n".join(
            f'canary_encoder_calls_total{{instance="{i}",model="text_encoder",result="{r}",version="{v}"}} {c}'
            for (v, i, r), c in series.items()
        )

    before = call_counts(text({(3, "a", "ok"): 10, (3, "a", "error"): 2}), "text_encoder")
    after = call_counts(
        text({(3, "a", "ok"): 30, (3, "a", "error"): 7, (3, "b", "error"): 4, (1, "a", "ok"): 99}), "text_encoder"
    )
    assert calls_between(before, after, 3) == (20, 9)
    assert calls_between(before, after, 1) == (99, 0)


def test_thresholds_are_checked():
    with pytest.raises(UsageError, match="--max-error-rate"):
        Thresholds(max_error_rate=1.5).check()
    with pytest.raises(UsageError, match="--p99-ratio"):
        Thresholds(p99_ratio=0.5).check()


def test_overrides_keep_the_config_and_set_versions_and_weights():
    encoder = config_from_disk(REPO, "text_encoder", None)
    assert encoder["name"] == "text_encoder" and encoder["model_warmup"]
    assert encoder_config(encoder, [2, 1])["version_policy"] == {"specific": {"versions": [1, 2]}}
    router = router_config(config_from_disk(REPO, "text_encoder_router", None), {2: 10, 1: 90})
    assert router["parameters"]["weights"] == {"string_value": "1:90,2:10"}
    assert router["parameters"]["encoder_model"] == {"string_value": "text_encoder"}
    with pytest.raises(RoutingError, match="sum to 110"):
        router_config(router, {1: 100, 2: 10})


def test_publish_next_version_is_atomic_and_immutable(tmp_path):
    v1 = tmp_path / "text_encoder" / "1"
    v1.mkdir(parents=True)
    (v1 / "model.onnx").write_bytes(b"onnx")
    (v1 / "model.int8.onnx").write_bytes(b"int8")
    (v1 / "notes.txt").write_text("not copied")
    assert publish(tmp_path) == 2
    assert sorted(p.name for p in (tmp_path / "text_encoder" / "2").iterdir()) == ["model.int8.onnx", "model.onnx"]
    assert publish(tmp_path, link=True) == 3
    with pytest.raises(UsageError, match="version 2 exists already"):
        publish(tmp_path, version=2)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="holds no model file"):
        publish(tmp_path, source=empty)


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    assert main(["publish", "--repository", str(tmp_path), "--version", "0"]) == 2
    assert "rollout:" in capsys.readouterr().err


def test_launcher_closure_and_what_the_state_defers(tmp_path):
    # The direct form reaches the encoder as a step; the router only through its own config.
    assert closure(REPO, "text_embedding") == ["text_embedding", "text_encoder", "text_tokenizer"]
    assert "text_encoder_router" not in with_dependencies(REPO, ["text_embedding", "text_embedding_cached"])
    assert with_dependencies(REPO, ["text_encoder_router"]) == ["text_encoder", "text_encoder_router"]
    from server.repository_prep import deferred_models, rollout_plan

    models = ("text_embedding", "text_embedding_cached")
    state = tmp_path / "state.json"
    assert rollout_plan(None) is None and rollout_plan(state) is None  # no state file
    assert deferred_models(REPO, models, rollout_plan(state)) == []
    # One version: the encoder first, then what uses it; no router.
    RolloutState(stable=2, weights={2: 100}, loaded=[2], phase="finished").save(state)
    plan = load_plan(state)
    assert not plan.routed and plan.overridden() == ["text_encoder"]
    assert deferred_models(REPO, models, rollout_plan(state)) == ["text_encoder", "text_embedding", "text_embedding_cached"]
    assert plan.override("text_embedding", REPO) is None  # its own config: the direct form
    # A user who asks for the router gets it with the state's weights, not its file's 1:100.
    models = ("text_embedding", "text_encoder_router")
    assert deferred_models(REPO, models, rollout_plan(state)) == ["text_encoder", "text_encoder_router", "text_embedding"]
    assert plan.override("text_encoder_router", REPO)["parameters"]["weights"] == {"string_value": "2:100"}
    # A rollout in progress: the router in front, text_embedding in the routed form.
    models = ("text_embedding", "text_embedding_cached")
    RolloutState(stable=1, candidate=2, weights={1: 50, 2: 50}, loaded=[1, 2], phase="canary").save(state)
    plan = load_plan(state)
    assert plan.routed and plan.overridden() == ["text_encoder", "text_encoder_router", "text_embedding"]
    assert deferred_models(REPO, models, rollout_plan(state)) == [
        "text_encoder",
        "text_encoder_router",
        "text_embedding",
        "text_embedding_cached",
    ]
    entry = plan.override("text_embedding", REPO)
    assert form_of(entry) == ROUTED and "ENCODER_VERSION" in [o["name"] for o in entry["output"]]
    assert plan.override("text_encoder", REPO)["version_policy"] == {"specific": {"versions": [1, 2]}}
    # Two versions loaded after a rollback whose unload failed: still routed.
    RolloutState(stable=1, weights={1: 100}, loaded=[1, 2], phase="rolled_back").save(state)
    assert load_plan(state).routed


def test_the_two_forms_of_text_embedding():
    direct = config_from_disk(REPO, "text_embedding", None)
    assert form_of(direct) == DIRECT and [o["name"] for o in direct["output"]] == ["EMBEDDING", "NUM_TOKENS"]
    routed = routed_form(direct)
    assert form_of(routed) == ROUTED and direct == config_from_disk(REPO, "text_embedding", None)  # a copy
    step = routed["ensemble_scheduling"]["step"][1]
    assert step["model_name"] == "text_encoder_router"
    assert step["output_map"] == {"sentence_embedding": "EMBEDDING", "encoder_version": "ENCODER_VERSION"}
    assert routed["output"][2] == {"name": "ENCODER_VERSION", "data_type": "TYPE_INT32", "dims": [1]}
    assert routed["ensemble_scheduling"]["step"][0] == direct["ensemble_scheduling"]["step"][0]  # NUM_TOKENS too
    # The router's inputs and outputs are the step's: the routed form is loadable as it is.
    router = config_from_disk(REPO, "text_encoder_router", None)
    assert set(step["input_map"]) == {i["name"] for i in router["input"]}
    assert set(step["output_map"]) == {o["name"] for o in router["output"]}
    assert routed_form(routed) == routed and direct_form(direct) == direct
    back = direct_form(routed)
    assert back["output"] == direct["output"] and form_of(back) == DIRECT
    assert back["ensemble_scheduling"]["step"][1]["output_map"] == {"sentence_embedding": "EMBEDDING"}
    with pytest.raises(ConfigError, match="no ensemble step is 'text_encoder'"):
        form_of(config_from_disk(REPO, "image_classification", None))


def test_token_created_once_with_private_mode(tmp_path, monkeypatch):
    monkeypatch.delenv(repository.TOKEN_ENV, raising=False)
    path = tmp_path / "t" / "token"
    token = repository.ensure_token(path)
    assert len(token) >= 32 and repository.ensure_token(path) == token
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    monkeypatch.setenv(repository.TOKEN_ENV, "from-env")
    assert repository.ensure_token(path) == "from-env"
    assert repository.token_headers() == {"triton-repository-token": "from-env"}


def test_p99_from_the_router_histogram_per_series():
    from ops.canary import latency_buckets, p99_between

    def text(series):
        lines = []
        for (version, instance), counts in series.items():
            for le, c in counts.items():
                lines.append(
                    f'canary_encoder_call_ms_bucket{{instance="{instance}",model="text_encoder",'
                    f'version="{version}",le="{le}"}} {c}'
                )
        return "\n".join(lines)

    before = latency_buckets(text({(1, "a"): {"5": 90, "10": 100, "+Inf": 100}}), "text_encoder")
    after = latency_buckets(
        text(
            {
                (1, "a"): {"5": 90, "10": 190, "+Inf": 200},  # +100, all in (5, 10]
                (2, "b"): {"5": 10, "10": 40, "+Inf": 50},
            }
        ),  # new series: counted whole
        "text_encoder",
    )
    assert p99_between(before, after, 1) == (10.0, 100)
    assert p99_between(before, after, 2) == (10.0, 50)
    assert p99_between(before, after, 3) == (None, 0)
    slow = latency_buckets(text({(2, "b"): {"5": 0, "10": 0, "+Inf": 10}}), "text_encoder")
    assert p99_between({}, slow, 2) == (10.0, 10)  # beyond the last bucket: its bound, a lower limit


def test_perf_helpers_send_the_token_to_the_repository_api(monkeypatch):
    import urllib.request

    from perf.lib import harness

    seen = []

    class Response:
        status = 200

        def read(self):
            return b"[]"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_urlopen(request, timeout=None):
        seen.append((request.full_url, {k.lower(): v for k, v in request.header_items()}))
        return Response()

    monkeypatch.setenv(repository.TOKEN_ENV, "perf-token")
    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    with pytest.raises(RuntimeError, match="no loaded model has dynamic batching"):
        harness.disable_all_dynamic_batching("h:1")
    assert seen[0][0] == "http://h:1/v2/repository/index"
    assert seen[0][1].get("triton-repository-token") == "perf-token"


class FakeClock:
    """The step clock and sleep of the rollout command, without waiting."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class FakeTriton:
    """Just enough of RepositoryClient for the command's state machine (the real server is in
    tests/integration/test_rollout.py). ``traffic``: (seconds after a weight change, calls)
    that reach the newest weighted version in every step. Like the router, the fake adds up
    calls in the process and shows them on the metrics port only ROUTER_FLUSH_S later."""

    ROUTER_FLUSH_S = 0.5

    def __init__(self, clock: FakeClock | None = None, traffic=((1.0, 100),)):
        self.encoder = {"name": "text_encoder", "version_policy": {"latest": {"num_versions": 1}}}
        self.router = config_from_disk(REPO, "text_encoder_router", None)
        # The steady state: text_embedding in its direct form, the router not loaded.
        self.entry = config_from_disk(REPO, "text_embedding", None)
        self.models = {"text_tokenizer", "text_encoder", "text_embedding"}
        self.loaded = {1}
        self.loads = []
        self.clock = clock or FakeClock()
        self.traffic = tuple(traffic)
        self.arrivals = []  # (at, version, router instance, calls)

    def config(self, model):
        if model not in self.models:
            raise repository.RepositoryError(f"config of {model}: HTTP 400: unknown model", 400)
        return dict({"text_encoder": self.encoder, "text_embedding": self.entry}.get(model, self.router))

    def load(self, model, config=None):
        self.loads.append((model, config))
        if model == "text_embedding":
            for step in config["ensemble_scheduling"]["step"]:  # Triton loads an ensemble's steps first
                assert step["model_name"] in self.models, f"step {step['model_name']} is not loaded"
        self.models.add(model)
        if model == "text_encoder":
            policy = config["version_policy"]  # a cluster puts a replica back with the config it served
            self.loaded = {int(v) for v in policy["specific"]["versions"]} if "specific" in policy else {1}
            self.encoder = config
        elif model == "text_embedding":
            self.entry = config
        else:
            self.router = config
            weights = dict(x.split(":") for x in config["parameters"]["weights"]["string_value"].split(","))
            newest = max(int(v) for v, w in weights.items() if int(w) > 0)
            instance = f"router-{len(self.loads)}"  # a reloaded router is a new series
            self.arrivals += [(self.clock.now + after, newest, instance, n) for after, n in self.traffic]

    def unload(self, model):
        self.loads.append((model, "unload"))
        self.models.discard(model)

    def form(self):
        from python_backends.routing.ensemble import form_of

        return form_of(self.entry)

    def ready(self, model, version=None):
        return model in self.models and (version is None or model != "text_encoder" or version in self.loaded)

    def version_stats(self, model):
        return {v: {"success": 0.0, "fail": 0.0, "success_ns": 0.0} for v in self.loaded}

    def metrics(self):
        series = {}
        for at, version, instance, n in self.arrivals:
            if at + self.ROUTER_FLUSH_S <= self.clock.now:
                series[(version, instance)] = series.get((version, instance), 0) + n
        return "\n".join(
            f'canary_encoder_calls_total{{instance="{i}",model="text_encoder",result="ok",version="{v}"}} {n}'
            for (v, i), n in series.items()
        )

    def answers(self):
        return True

    def infer_json(self, model, body):
        version = body["parameters"]["encoder_version"]
        return {"outputs": [{"name": "ENCODER_VERSION", "data": [version]}, {"name": "EMBEDDING", "data": [1.0] + [0.0] * 383}]}


def _rollout(tmp_path, triton, said=None):
    from ops.rollout import Rollout

    return Rollout(
        triton,
        tmp_path / "state.json",
        say=(said if said is not None else []).append,
        sleep=triton.clock.sleep,
        clock=triton.clock.time,
    )


def test_command_state_machine(tmp_path):
    triton, said = FakeTriton(), []
    rollout = _rollout(tmp_path, triton, said)
    with pytest.raises(UsageError, match="nothing to roll back"):
        rollout.rollback()
    with pytest.raises(UsageError, match="version 1 is already the serving version"):
        rollout.start(1)
    # 100 calls of version 2 one second into each step: every step is judged and passes.
    assert rollout.start(2, [10, 100], dwell_s=5, check_interval_s=1) == 0
    passed = [e for e in RolloutState.load(tmp_path / "state.json").history if e["event"].endswith("passed")]
    assert [(e["event"], e["calls"], e["failed"]) for e in passed] == [("step 1 passed", 100, 0), ("step 2 passed", 100, 0)]
    assert triton.loaded == {1, 2}
    assert triton.router["parameters"]["weights"]["string_value"] == "1:0,2:100"
    state = RolloutState.load(tmp_path / "state.json")
    assert state.phase == "rolled_out" and state.step == 1 and state.loaded == [1, 2]
    with pytest.raises(UsageError, match="run `rollout finish`"):
        rollout.start(3)
    with pytest.raises(UsageError, match="rollback window is open for"):
        rollout.finish()
    state = RolloutState.load(tmp_path / "state.json")
    state.rollback_window_s = 0.2  # --wait sleeps until it closed
    state.save(tmp_path / "state.json")
    rollout.sleep = time.sleep
    assert rollout.finish(wait=True) == 0
    assert triton.loaded == {2} and triton.router["parameters"]["weights"]["string_value"] == "2:100"
    state = RolloutState.load(tmp_path / "state.json")
    assert (state.phase, state.stable, state.candidate) == ("finished", 2, None)
    assert [e["event"] for e in state.history][0] == "start"


def test_rollback_restores_weights_before_unloading(tmp_path):
    triton = FakeTriton()
    rollout = _rollout(tmp_path, triton)
    assert rollout.start(2, [50, 100], dwell_s=0, check_interval_s=0) == 0
    triton.loads.clear()
    assert rollout.rollback() == 0
    # Traffic first, then the unload, then the direct form, then the router goes.
    assert [(m, c if c == "unload" else "load") for m, c in triton.loads] == [
        ("text_encoder_router", "load"),
        ("text_encoder", "load"),
        ("text_embedding", "load"),
        ("text_encoder_router", "unload"),
    ]
    assert triton.router["parameters"]["weights"]["string_value"] == "1:100" and triton.loaded == {1}
    assert triton.form() == DIRECT and not triton.ready("text_encoder_router")
    assert RolloutState.load(tmp_path / "state.json").phase == "rolled_back"


def test_the_router_goes_in_front_before_the_new_version_loads(tmp_path):
    triton = FakeTriton()
    rollout = _rollout(tmp_path, triton)
    assert rollout.start(2, [50, 100], dwell_s=0, check_interval_s=0) == 0
    order = [m for m, _ in triton.loads]
    # The router (weights 1:100, from the repository: it was not loaded), then the routed
    # form, then version 2.
    assert order[:3] == ["text_encoder_router", "text_embedding", "text_encoder"], order
    assert triton.loads[0][1]["parameters"]["weights"] == {"string_value": "1:100"}
    assert triton.loads[2][1]["version_policy"] == {"specific": {"versions": [1, 2]}}
    assert triton.form() == ROUTED
    events = [e["event"] for e in RolloutState.load(tmp_path / "state.json").history]
    assert events[:2] == ["start", "router in front"]
    triton.loads.clear()
    assert rollout.finish(force=True) == 0
    assert [(m, c if c == "unload" else "load") for m, c in triton.loads] == [
        ("text_encoder_router", "load"),
        ("text_encoder", "load"),
        ("text_embedding", "load"),
        ("text_encoder_router", "unload"),
    ]
    assert triton.loaded == {2} and triton.form() == DIRECT
    state = RolloutState.load(tmp_path / "state.json")
    assert state.history[-1]["event"] == "router out" and state.history[-1]["serving"] == 2
    assert not load_plan(tmp_path / "state.json").routed
    # The next rollout starts from version 2 and puts the router back with 2:100.
    triton.loads.clear()
    assert rollout.start(3, [100], dwell_s=0, check_interval_s=0) == 0
    assert triton.loads[0][0] == "text_encoder_router"
    assert triton.loads[0][1]["parameters"]["weights"] == {"string_value": "2:100"}


def test_a_router_loaded_before_the_rollout_stays_loaded(tmp_path):
    triton = FakeTriton()
    triton.models.add("text_encoder_router")  # a user calls it directly
    rollout = _rollout(tmp_path, triton)
    assert rollout.start(2, [100], dwell_s=0, check_interval_s=0) == 0
    assert RolloutState.load(tmp_path / "state.json").router_kept
    assert rollout.rollback() == 0
    assert triton.form() == DIRECT and triton.ready("text_encoder_router")
    assert ("text_encoder_router", "unload") not in triton.loads


def test_first_use_reads_the_serving_version_from_the_encoder(tmp_path):
    triton = FakeTriton()
    triton.loaded = {4}
    assert _rollout(tmp_path, triton).state().stable == 4


def test_a_version_failing_its_smoke_check_is_aborted_before_any_traffic(tmp_path):
    triton = FakeTriton()
    triton.infer_json = lambda model, body: {
        "outputs": [{"name": "ENCODER_VERSION", "data": [1]}, {"name": "EMBEDDING", "data": [1.0]}]
    }
    rollout = _rollout(tmp_path, triton)
    assert rollout.start(2, dwell_s=0, check_interval_s=0) == 1
    state = RolloutState.load(tmp_path / "state.json")
    assert state.phase == "aborted" and "smoke check of version 2: served by 1" in state.reason
    assert triton.form() == DIRECT and not triton.ready("text_encoder_router")  # the router out again
    assert triton.loaded == {1} and triton.router["parameters"]["weights"]["string_value"] == "1:100"


def test_a_step_without_traffic_rolls_back_after_the_traffic_timeout(tmp_path):
    triton, said = FakeTriton(traffic=()), []
    rollout = _rollout(tmp_path, triton, said)
    started = triton.clock.now
    assert (
        rollout.start(2, [10, 100], dwell_s=60, check_interval_s=5, thresholds=Thresholds(min_requests=20, traffic_timeout_s=120))
        == 1
    )
    state = RolloutState.load(tmp_path / "state.json")
    assert state.phase == "aborted" and state.weights == {1: 100} and triton.loaded == {1}
    assert "0 calls of version 2, fewer than 20: not judged after the 60 s dwell" in state.reason
    assert "a step is not passed on no evidence" in state.reason
    assert not any(e["event"].endswith("passed") for e in state.history)  # stopped in step 1
    assert 180 <= triton.clock.now - started < 190  # the dwell, then the whole timeout
    assert any("waiting up to 120 s for traffic" in m for m in said)


def test_allow_unjudged_passes_a_step_without_traffic_with_a_warning(tmp_path):
    triton, said = FakeTriton(traffic=()), []
    rollout = _rollout(tmp_path, triton, said)
    assert (
        rollout.start(2, [10, 100], dwell_s=60, check_interval_s=5, thresholds=Thresholds(min_requests=20, allow_unjudged=True))
        == 0
    )
    assert RolloutState.load(tmp_path / "state.json").phase == "rolled_out"
    warnings = [m for m in said if "WARNING" in m]
    assert len(warnings) == 2 and all("passes UNJUDGED (--allow-unjudged)" in m for m in warnings), said


def test_traffic_arriving_late_within_the_timeout_is_judged(tmp_path):
    # 25 calls of version 2 arrive 90 s into each 60 s step: 30 s into the 120 s wait.
    triton, said = FakeTriton(traffic=((90.0, 25),)), []
    rollout = _rollout(tmp_path, triton, said)
    started = triton.clock.now
    assert (
        rollout.start(2, [10, 100], dwell_s=60, check_interval_s=5, thresholds=Thresholds(min_requests=20, traffic_timeout_s=120))
        == 0
    )
    passed = [e for e in RolloutState.load(tmp_path / "state.json").history if e["event"].endswith("passed")]
    assert [e["calls"] for e in passed] == [25, 25]
    assert triton.clock.now - started < 2 * 100  # judged when the calls came, not at the deadline


def test_the_final_read_waits_for_the_routers_last_flush(tmp_path):
    # All of the step's calls come 0.2 s before its end; the router shows them 0.5 s later.
    # Without waiting past the flush the step would see 0 calls and (no timeout) roll back.
    triton = FakeTriton(traffic=((9.8, 30),))
    rollout = _rollout(tmp_path, triton)
    assert (
        rollout.start(2, [100], dwell_s=10, check_interval_s=5, thresholds=Thresholds(min_requests=20, traffic_timeout_s=0)) == 0
    )
    passed = [e for e in RolloutState.load(tmp_path / "state.json").history if e["event"].endswith("passed")]
    assert [e["calls"] for e in passed] == [30]


def test_cli_exits_non_zero_when_a_step_saw_no_traffic(tmp_path, monkeypatch, capsys):
    import ops.rollout as rollout_module

    triton = FakeTriton(traffic=())
    monkeypatch.setattr(rollout_module, "connect", lambda *a, **k: triton)
    args = [
        "--state-file",
        str(tmp_path / "state.json"),
        "start",
        "2",
        "--steps",
        "100",
        "--dwell",
        "0",
        "--check-interval",
        "0",
        "--traffic-timeout",
        "0",
    ]
    assert main(args) == 1
    assert "ABORT" in capsys.readouterr().out
    assert RolloutState.load(tmp_path / "state.json").phase == "aborted"
    assert (
        main(
            args[:2]
            + [
                "start",
                "3",
                "--steps",
                "100",
                "--dwell",
                "0",
                "--check-interval",
                "0",
                "--traffic-timeout",
                "0",
                "--allow-unjudged",
            ]
        )
        == 0
    )
    assert "passes UNJUDGED" in capsys.readouterr().out


def test_status_names_the_form(tmp_path):
    triton = FakeTriton()
    rollout = _rollout(tmp_path, triton)
    info = rollout.status()
    assert info["form"].startswith("tokenizer -> text_encoder (one version") and "served_weights" not in info
    assert rollout.start(2, [100], dwell_s=0, check_interval_s=0) == 0
    info = rollout.status()
    assert "text_encoder_router" in info["form"] and info["served_weights"] == "1:0,2:100"


# ---------------------------------------------------------------- a cluster (ReplicatedRepositoryClient)


class RefusingTriton(FakeTriton):
    """A replica that cannot load ``version`` of the encoder (say its disk lacks the folder)."""

    def __init__(self, version, **kw):
        super().__init__(**kw)
        self.refused_version = version

    def load(self, model, config=None):
        if model == "text_encoder" and self.refused_version in config["version_policy"]["specific"]["versions"]:
            raise repository.RepositoryError(f"load of text_encoder: HTTP 400: version {self.refused_version} failed", 400)
        super().load(model, config)


class DownTriton(FakeTriton):
    """A replica that is down (restarting): every call fails to connect."""

    def answers(self):
        return False

    def _down(self, *a, **k):
        raise repository.RepositoryError("connection refused", 0)

    load = unload = config = _down

    def ready(self, model, version=None):
        return False


def _cluster(tmp_path, replicas, said=None):
    from ops.rollout import Rollout

    client = repository.ReplicatedRepositoryClient(replicas)
    return Rollout(
        client,
        tmp_path / "state.json",
        say=(said if said is not None else []).append,
        sleep=replicas[0].clock.sleep,
        clock=replicas[0].clock.time,
    )


def test_a_cluster_rollout_acts_on_every_replica_and_judges_their_traffic_together(tmp_path):
    clock = FakeClock()
    # 15 calls of version 2 per step on each replica: neither alone reaches --min-requests 20.
    replicas = [FakeTriton(clock=clock, traffic=((1.0, 15),)) for _ in range(2)]
    rollout = _cluster(tmp_path, replicas)
    assert rollout.start(2, [50, 100], dwell_s=3, check_interval_s=1) == 0
    passed = [e for e in RolloutState.load(tmp_path / "state.json").history if e["event"].endswith("passed")]
    assert [e["calls"] for e in passed] == [30, 30]
    for triton in replicas:
        assert triton.loaded == {1, 2} and triton.router["parameters"]["weights"]["string_value"] == "1:0,2:100"
    assert rollout.rollback() == 0
    for triton in replicas:
        assert triton.loaded == {1} and triton.form() == DIRECT and not triton.ready("text_encoder_router")


def test_a_replica_refusing_the_version_rolls_every_replica_back(tmp_path):
    clock = FakeClock()
    good, refusing = FakeTriton(clock=clock), RefusingTriton(2, clock=clock)
    said = []
    rollout = _cluster(tmp_path, [good, refusing], said)
    assert rollout.start(2, [50, 100], dwell_s=0, check_interval_s=0) == 1
    # the first replica had loaded version 2: it was put back before the error reached the command
    assert good.loaded == {1} and refusing.loaded == {1}
    assert good.form() == DIRECT and refusing.form() == DIRECT
    assert not good.ready("text_encoder_router") and not refusing.ready("text_encoder_router")
    state = RolloutState.load(tmp_path / "state.json")
    assert state.phase == "aborted" and "replica 1" in state.reason and "put back as they were" in state.reason
    assert any("ABORT" in line for line in said)


def test_a_replica_that_is_down_is_skipped_and_ready_asks_the_others(tmp_path):
    clock = FakeClock()
    up, down = FakeTriton(clock=clock), DownTriton(clock=clock)
    client = repository.ReplicatedRepositoryClient([up, down], ["replica 0", "replica 1"])
    assert client.load("text_encoder", {"version_policy": {"specific": {"versions": [1, 2]}}}) == ["replica 1"]
    assert up.loaded == {1, 2} and client.ready("text_encoder", 2)
    both_down = repository.ReplicatedRepositoryClient([DownTriton(clock=clock)])
    with pytest.raises(repository.RepositoryError, match="no replica answers"):
        both_down.load("text_encoder", {"version_policy": {"specific": {"versions": [1]}}})
    assert not both_down.ready("text_encoder")


def test_cluster_metrics_keep_the_replicas_series_apart():
    clock = FakeClock()
    replicas = [FakeTriton(clock=clock) for _ in range(2)]
    for t in replicas:
        t.arrivals.append((0.0, 2, "router-0", 7))
    clock.now = 5.0
    client = repository.ReplicatedRepositoryClient(replicas)
    from ops.canary import call_counts, calls_between

    counts = call_counts(client.metrics(), "text_encoder")
    assert len(counts) == 2 and calls_between({}, counts, 2) == (14, 0)


def _configs_only(tmp_path):
    """model_repository's configs (no model files) with its lanes rendered, as `make export` leaves them."""
    import shutil

    from export.lanes import render_all

    copy = tmp_path / "model_repository"
    for config in REPO.glob("*/config.pbtxt"):
        (copy / config.parent.name / "1").mkdir(parents=True)
        shutil.copyfile(config, copy / config.parent.name / "config.pbtxt")
        if (config.parent / "configs").is_dir():
            shutil.copytree(config.parent / "configs", copy / config.parent.name / "configs")
    render_all(copy)
    return copy


def test_a_read_only_repository_pins_the_lanes_by_an_override(tmp_path, monkeypatch):
    """A container's repository is a read-only mount: a replica restarted mid-rollout cannot render its
    lanes pinned to the stable version, so it loads them through the API with the pinned config (here
    the mount's refusal is raised by the lanes' one writer, export/lanes.py's _write)."""
    import errno

    from export import lanes
    from server.repository_prep import RepositoryNotWritable, prepare

    repo = _configs_only(tmp_path)
    (repo / "text_encoder" / "2").mkdir()
    lanes.render_all(repo)  # what `ops.rollout publish` does on the host
    state = tmp_path / "state.json"
    RolloutState(stable=1, candidate=2, weights={1: 0, 2: 100}, loaded=[1, 2], phase="canary").save(state)

    def read_only(path, text):
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(lanes, "_write", read_only)
    models = ("text_embedding", "text_embedding_interactive", "text_embedding_cached_interactive")
    prepared = prepare(repo, models, state)
    assert prepared.lane_pins == {"text_encoder_interactive": 2}
    deferred = list(prepared.deferred)
    # the encoder and the router first, then the pinned lane, then what reaches any of them
    assert deferred[:3] == ["text_encoder", "text_encoder_router", "text_encoder_interactive"]
    assert {"text_embedding", "text_embedding_interactive", "text_embedding_cached_interactive"} <= set(deferred[3:])
    from server.repository_prep import pinned_lane_config

    for config_name in (None, "cpu"):
        override = pinned_lane_config(repo, "text_encoder_interactive", 2, config_name)
        assert override["name"] == "text_encoder_interactive"
        # (protobuf's JSON writes int64 as strings; tritonserver's parser reads both)
        assert [int(v) for v in override["version_policy"]["specific"]["versions"]] == [2]
    # without a rollout nothing needs pinning: the mount's files serve as they are
    assert prepare(repo, models, None).lane_pins == {}
    # a mount whose lanes were never rendered is refused, saying what to run
    (repo / "text_encoder_interactive" / "config.pbtxt").unlink()
    with pytest.raises(RepositoryNotWritable, match=r"read-only .* `python -m export.lanes`"):
        prepare(repo, models, state)
