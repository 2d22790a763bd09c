"""``python -m ops.rollout``: publish, canary-roll out, watch, roll back and finish a
text_encoder version on a running server (docs/versions-and-rollout.md).

    rollout publish            copy the exported model files into the next version folder
    rollout start 2            put the canary router in front of text_encoder (text_embedding's
                               routed form), load + warm version 2 next to the serving one, check it, then
                               10 % -> 50 % -> 100 % with a dwell per step; between checks it
                               reads the router's per-version metrics (and Triton's statistics)
                               and rolls back by itself when the error rate or the P99 regress,
                               or when a step's traffic is too thin to judge (--min-requests
                               calls of the new version within --traffic-timeout after the
                               dwell; --allow-unjudged passes such a step with a warning)
    rollout status             the state file and what the server reports per version
    rollout rollback           100 % back to the previous version at once, then unload the new one
                               and take the router out again (text_embedding's direct form)
    rollout finish             after the rollback window (default 15 min): unload the old version
                               and take the router out (--wait: wait for the window first; --force: do not)

The state (versions, weights, step, times, history) is one JSON file, written atomically
after every change, so a restarted ``rollout start`` resumes its step, ``rollback`` and
``status`` work from another shell, and ``python -m server`` re-applies the versions, the
weights and the form of text_embedding on start. The weights live in the router's config
(``text_encoder_router``, parameter ``weights``): each change reloads the router with a config
override through the repository API, which needs the repository token (ops/repository.py).

Outside a rollout the router is not on the request path: text_embedding's steady-state form is
``text_tokenizer -> text_encoder`` with one version loaded (python_backends/routing/ensemble.py).
``start`` reloads text_embedding with the router as its second step BEFORE it loads the new
version; ``finish``, ``rollback`` and an abort put the direct form back once one version is
loaded, then unload the router (unless it was loaded before the rollout began).

Exit status: 0 done, 1 aborted (a version that does not load, e.g. an unknown one, aborts
too) or refused by the server, 2 bad input (steps, thresholds, weights not summing to 100, a
rollout already in progress, nothing to roll back, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from contract.errors import ConfigError
from ops.canary import (
    FLUSH_WAIT_S,
    Verdict,
    call_counts,
    calls_between,
    judge,
    latency_buckets,
    p99_between,
)
from ops.configs import config_from_disk
from ops.repository import ROOT, AnyRepositoryClient, ReplicatedRepositoryClient, RepositoryError, connect
from python_backends.routing.ensemble import ROUTED, describe_form, direct_form, form_of, routed_form
from python_backends.routing.weights import RoutingError, format_weights, parse_weights, validate_weights

log = logging.getLogger(__name__)

ENCODER = "text_encoder"
ROUTER = "text_encoder_router"
ENTRY = "text_embedding"  # the ensemble whose encoder step the router takes during a rollout
SMOKE_MODEL = "text_embedding"
# The smoke check's text: the encoder's warmup sentence (common word pieces only).
SMOKE_TEXT = "A man is playing a guitar."
DEFAULT_STATE_FILE = ROOT / ".rollout" / "state.json"
STATE_ENV = "ROLLOUT_STATE_FILE"
DEFAULT_STEPS = (10, 50, 100)
DEFAULT_DWELL_S = 60.0
DEFAULT_WINDOW_S = 15 * 60.0
# Files a version folder holds (what `python -m export` writes into text_encoder/1/).
VERSION_FILES = ("*.onnx", "*.onnx.data", "*.plan", "*.export.json")


class UsageError(ValueError):
    """Bad input or a state that does not allow the command; exit status 2."""


@dataclass
class Thresholds:
    """When a canary step fails. The error rate is the new version's failed / all encoder calls
    of the router during the step (``canary_encoder_calls_total``; Triton's statistics count a
    Python model's error responses as successes, so they only add a native backend's failures). P99 is the router's encoder-call histogram (``canary_encoder_call_ms``)
    over the step, new version against stable version in the same window: it regresses when
    it exceeds both ``p99_ratio`` x and ``p99_slack_ms`` + the stable P99. (Triton's own
    per-version latency summary counts the warmup samples of a fresh version, which dominate
    its P99 for minutes.) Nothing is judged before the new version served ``min_requests``.

    A step that has not seen ``min_requests`` calls of the new version by the end of its dwell
    waits up to ``traffic_timeout_s`` more for them; still short, it fails (the rollout stops
    and rolls back), because passing it would promote the version on no evidence. Only
    ``allow_unjudged`` (``--allow-unjudged``) lets such a step pass, with a warning."""

    max_error_rate: float = 0.01
    p99_ratio: float = 1.5
    p99_slack_ms: float = 20.0
    min_requests: int = 20
    traffic_timeout_s: float = 120.0
    allow_unjudged: bool = False

    def check(self) -> Thresholds:
        if not 0 <= self.max_error_rate < 1:
            raise UsageError(f"--max-error-rate must be in [0, 1), got {self.max_error_rate}")
        if self.p99_ratio < 1:
            raise UsageError(f"--p99-ratio must be >= 1, got {self.p99_ratio}")
        if self.p99_slack_ms < 0 or self.min_requests < 1:
            raise UsageError("--p99-slack-ms must be >= 0 and --min-requests >= 1")
        if self.traffic_timeout_s < 0:
            raise UsageError(f"--traffic-timeout must be >= 0, got {self.traffic_timeout_s}")
        return self


@dataclass
class RolloutState:
    encoder: str = ENCODER
    router: str = ROUTER
    entry: str = ENTRY
    stable: int = 1  # the version that serves when the rollout is rolled back
    candidate: int | None = None  # the version being rolled out
    weights: dict = field(default_factory=lambda: {1: 100})
    loaded: list = field(default_factory=lambda: [1])  # text_encoder versions kept loaded
    phase: str = "idle"  # idle | canary | rolled_out | rolled_back | aborted | finished
    steps: list = field(default_factory=lambda: list(DEFAULT_STEPS))
    step: int = -1  # index into steps of the weight in effect
    dwell_s: float = DEFAULT_DWELL_S
    rollback_window_s: float = DEFAULT_WINDOW_S
    thresholds: dict = field(default_factory=lambda: asdict(Thresholds()))
    started_at: float | None = None
    step_started_at: float | None = None
    completed_at: float | None = None  # when 100 % was reached and held
    baseline_p99_ms: float | None = None
    reason: str = ""
    # The router was loaded before this rollout put it in front (a user calls it directly):
    # taking it out of text_embedding then leaves it loaded.
    router_kept: bool = False
    history: list = field(default_factory=list)

    # -- persistence
    @classmethod
    def load(cls, path: Path) -> RolloutState | None:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise UsageError(f"rollout state {path}: unreadable ({exc})") from None
        raw["weights"] = {int(k): int(v) for k, v in raw.get("weights", {}).items()}
        known = {f for f in cls.__dataclass_fields__}
        state = cls(**{k: v for k, v in raw.items() if k in known})
        validate_weights(state.weights, f"rollout state {path}: weights")
        return state

    def save(self, path: Path) -> None:
        """Atomically: a reader never sees half a file, a crash leaves the previous state."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        data = asdict(self)
        data["weights"] = {str(k): v for k, v in sorted(self.weights.items())}
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def routed(self) -> bool:
        """Whether text_embedding needs the router in front: during a rollout, or whenever more
        than one encoder version is loaded (the direct form would send all traffic to the newest)."""
        return self.phase in ("canary", "rolled_out") or len(set(self.loaded)) > 1

    def event(self, what: str, **details: Any) -> None:
        self.history.append({"at": round(time.time(), 3), "event": what, **details})
        log.info("rollout: %s %s", what, " ".join(f"{k}={v}" for k, v in details.items()))


# ---------------------------------------------------------------- server-side changes


def encoder_config(config: dict, versions: list[int]) -> dict:
    """The encoder's config with ``version_policy { specific { versions } }``."""
    out = dict(config)
    out["version_policy"] = {"specific": {"versions": sorted(set(int(v) for v in versions))}}
    return out


def router_config(config: dict, weights: dict) -> dict:
    out = dict(config)
    params = dict(out.get("parameters") or {})
    params["weights"] = {"string_value": format_weights(validate_weights(weights))}
    out["parameters"] = params
    return out


def set_versions(client: AnyRepositoryClient, encoder: str, versions: list[int]) -> None:
    """Load exactly ``versions`` of the encoder (new ones warmed; Triton answers when ready)."""
    client.load(encoder, encoder_config(client.config(encoder), versions))
    for v in versions:
        if not client.ready(encoder, v):
            raise RepositoryError(f"{encoder} version {v} is not ready after its load")


def set_weights(client: AnyRepositoryClient, router: str, weights: dict, base: dict | None = None) -> None:
    """Swap the router for one with ``weights``; the old one serves until the new one is loaded.
    ``base``: the config to override (default: the served one; a router not loaded has none)."""
    client.load(router, router_config(base if base is not None else client.config(router), weights))


def served_weights(client: AnyRepositoryClient, router: str) -> dict:
    raw = client.config(router).get("parameters", {}).get("weights", {}).get("string_value", "")
    return parse_weights(raw, f"{router} parameter 'weights'")


# ---------------------------------------------------------------- commands


def check_steps(steps: list[int]) -> list[int]:
    if not steps or any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)) or steps[-1] != 100:
        raise UsageError(f"--steps must be increasing percentages in 1..100 ending at 100, got {','.join(map(str, steps))}")
    return steps


class Rollout:
    """The commands, on one server and one state file."""

    def __init__(
        self,
        client: AnyRepositoryClient,
        state_path: Path,
        say: Callable[[str], None] = print,
        sleep: Callable[[float], None] = time.sleep,
        smoke_model: str = SMOKE_MODEL,
        clock: Callable[[], float] = time.time,
        repository: Path = ROOT / "model_repository",
        config_name: str | None = None,
    ):
        self.client = client
        self.state_path = Path(state_path)
        # Where the config of a model that is not loaded comes from (the router before a rollout
        # puts it in front): the server's model repository, as this checkout holds it.
        self.repository = Path(repository)
        self.config_name = config_name
        self.say = say
        self.sleep = sleep
        self.smoke_model = smoke_model
        self.clock = clock  # the step clock (dwell, traffic timeout); tests pass a fake one

    # -- state
    def state(self) -> RolloutState:
        state = RolloutState.load(self.state_path)
        if state is None:
            # First use: what the server serves now (the router's weights if it is in front,
            # else the newest loaded encoder version, which the direct form serves).
            if self._routed_now(ENTRY, ENCODER, ROUTER):
                weights = served_weights(self.client, ROUTER)
                stable = max(weights, key=lambda v: (weights[v], v))
            else:
                stable = max(self.client.version_stats(ENCODER), default=1)
            state = RolloutState(stable=stable, weights={stable: 100}, loaded=[stable])
        return state

    def _routed_now(self, entry: str, encoder: str, router: str) -> bool:
        """Whether ``entry`` is loaded in its routed form with the router loaded."""
        if not self.client.ready(entry):
            return False
        try:
            return form_of(self.client.config(entry), encoder, router) == ROUTED and self.client.ready(router)
        except ConfigError as exc:
            raise RepositoryError(str(exc)) from exc

    def _config(self, model: str) -> dict:
        """The served config of ``model``, or its repository config when it is not loaded."""
        if self.client.ready(model):
            return self.client.config(model)
        return config_from_disk(self.repository, model, self.config_name)

    def _route(self, state: RolloutState) -> None:
        """Put the router in front of the encoder (text_embedding's routed form), weights
        ``state.weights``: the router is loaded, then text_embedding swapped for its routed
        form (Triton serves the old one until the new one is ready)."""
        if self._routed_now(state.entry, state.encoder, state.router):
            return
        if state.history and state.history[-1]["event"] == "start":  # not a resumed start: we may have loaded it
            state.router_kept = self.client.ready(state.router)
        weights = validate_weights(state.weights)
        self.say(
            f"rollout: {state.entry}: {describe_form(ROUTED, state.encoder, state.router)}, weights {format_weights(weights)}"
        )
        set_weights(self.client, state.router, weights, base=self._config(state.router))
        self.client.load(state.entry, routed_form(self.client.config(state.entry), state.encoder, state.router))
        state.event("router in front", weights=format_weights(weights))
        self._save(state)

    def _unroute(self, state: RolloutState) -> None:
        """Back to the direct form once one version is loaded, then unload the router (kept
        if it was loaded before the rollout). A failure leaves the router in front, which
        serves the one version correctly, only slower: reported, not raised."""
        if state.routed():
            return
        try:
            entry = self.client.config(state.entry)
            if form_of(entry, state.encoder, state.router) == ROUTED:
                self.client.load(state.entry, direct_form(entry, state.encoder, state.router))
                state.event("router out", serving=state.stable)
                self._save(state)
                self.say(f"rollout: {state.entry}: {describe_form('direct', state.encoder, state.router)}")
            if not state.router_kept and self.client.ready(state.router):
                self.client.unload(state.router)
        except (RepositoryError, ConfigError) as exc:
            self.say(
                f"rollout: the router could not be taken out of {state.entry} ({exc}); version {state.stable} serves through it"
            )

    def _save(self, state: RolloutState) -> None:
        state.save(self.state_path)

    def _apply_weights(self, state: RolloutState, weights: dict, what: str) -> None:
        weights = validate_weights(weights)
        set_weights(self.client, state.router, weights)
        state.weights = weights
        state.event(what, weights=format_weights(weights))
        self._save(state)

    def _smoke(self, state: RolloutState, version: int) -> None:
        """One request pinned to ``version`` through the entry model: it must answer from it."""
        body = {
            "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [SMOKE_TEXT]}],
            "parameters": {"encoder_version": version},
        }
        if isinstance(self.client, ReplicatedRepositoryClient):  # a cluster: each replica must pass
            replicas, names = self.client.replicas, self.client.names
        else:
            replicas, names = [self.client], []
        for index, client in enumerate(replicas):
            result = client.infer_json(self.smoke_model, body)
            outputs = {o["name"]: o["data"] for o in result.get("outputs", [])}
            served = outputs.get("ENCODER_VERSION", [None])[0]
            vector = outputs.get("EMBEDDING") or []
            norm = math.sqrt(sum(x * x for x in vector)) if vector else 0.0
            if served != version or not 0.99 < norm < 1.01:
                where = f" on {names[index]}" if len(replicas) > 1 else ""
                raise RepositoryError(f"smoke check of version {version}{where}: served by {served}, |embedding| = {norm:.3f}")

    # -- start / resume
    def start(
        self,
        version: int,
        steps: list[int] | None = None,
        dwell_s: float | None = None,
        thresholds: Thresholds | None = None,
        check_interval_s: float = 5.0,
        window_s: float | None = None,
    ) -> int:
        state = self.state()
        if state.phase == "canary" and state.candidate == version:
            self.say(f"rollout: resuming version {version} at step {state.step + 1} of {len(state.steps)}")
        elif state.phase == "canary":
            raise UsageError(
                f"a rollout of version {state.candidate} is in progress (step {state.step + 1}); "
                f"roll it back or let it finish first"
            )
        elif state.phase == "rolled_out":
            raise UsageError(
                f"version {state.candidate} is rolled out and version {state.stable} kept for rollback; "
                f"run `rollout finish` (or `rollback`) before starting another rollout"
            )
        else:
            if version == state.stable:
                raise UsageError(f"version {version} is already the serving version")
            if version < 1:
                raise UsageError(f"version must be >= 1, got {version}")
            steps = check_steps(list(steps or DEFAULT_STEPS))
            state.candidate, state.steps, state.step = version, steps, -1
            state.dwell_s = float(DEFAULT_DWELL_S if dwell_s is None else dwell_s)
            state.rollback_window_s = float(DEFAULT_WINDOW_S if window_s is None else window_s)
            state.thresholds = asdict((thresholds or Thresholds()).check())
            state.phase, state.reason = "canary", ""
            state.started_at, state.completed_at, state.step_started_at = time.time(), None, None
            state.event("start", stable=state.stable, candidate=version, steps=steps, dwell_s=state.dwell_s)
            self._save(state)
        version = state.candidate
        limits = Thresholds(**state.thresholds)
        try:
            # Before the new version is loaded: the direct form's model_version -1 would send
            # it all traffic the moment it is ready.
            self._route(state)
            if not (self.client.ready(state.encoder, version) and self.client.ready(state.encoder, state.stable)):
                self.say(f"rollout: loading {state.encoder} versions {state.stable} and {version} (warmup runs at load)")
                set_versions(self.client, state.encoder, [state.stable, version])
            state.loaded = sorted({state.stable, version})
            self._save(state)
            self._smoke(state, version)
            self.say(f"rollout: version {version} is ready and answered a pinned request")
        except (RepositoryError, RoutingError) as exc:
            return self._abort(state, f"version {version} could not be loaded or checked: {exc}")
        first = state.step if state.step >= 0 else 0
        for index in range(first, len(state.steps)):
            percent = state.steps[index]
            resumed = index == state.step and state.step_started_at is not None
            if not resumed:
                weights = {state.stable: 100 - percent, version: percent}
                self._apply_weights(state, weights, f"step {index + 1}: {percent} % to version {version}")
                state.step, state.step_started_at = index, self.clock()
                self._save(state)
                self.say(f"rollout: {format_weights(state.weights)} (step {index + 1} of {len(state.steps)})")
            verdict = self._watch(state, limits, check_interval_s)
            if verdict is None:
                changed = RolloutState.load(self.state_path)
                self.say(
                    f"rollout: stopped, the state changed to {changed.phase if changed else 'none (no state file)'} meanwhile"
                )
                return 1
            if not verdict.ok:
                return self._abort(state, verdict.reason, verdict.figures)
            state.event(f"step {index + 1} passed", **verdict.figures)
            self._save(state)
            self.say(f"rollout: step {index + 1} passed: {verdict.reason} {verdict.figures}")
        state.phase, state.completed_at = "rolled_out", time.time()
        state.event("rolled out", candidate=version, keep_until=round(state.completed_at + state.rollback_window_s))
        self._save(state)
        self.say(
            f"rollout: version {version} serves 100 %; version {state.stable} stays loaded for "
            f"{state.rollback_window_s:.0f} s (`rollout rollback` until then, `rollout finish` after)"
        )
        return 0

    def _watch(self, state: RolloutState, limits: Thresholds, interval_s: float) -> Verdict | None:
        """Dwell on the current step, checking every ``interval_s``; None if another command
        changed the state meanwhile (a rollback from another shell). A step whose dwell ended
        before the new version served ``min_requests`` calls waits for them up to
        ``limits.traffic_timeout_s``, then fails, unless ``limits.allow_unjudged``."""
        candidate = state.candidate
        # start() sets both before it watches a step (a resumed step keeps its start time).
        assert candidate is not None and state.step_started_at is not None
        stats_before = self.client.version_stats(state.encoder)
        text = self.client.metrics()
        calls_before, hist_before = call_counts(text, state.encoder), latency_buckets(text, state.encoder)
        end = state.step_started_at + state.dwell_s
        deadline = end + limits.traffic_timeout_s
        waiting = False
        while True:
            now = self.clock()
            final = now >= end
            if final:
                self.sleep(FLUSH_WAIT_S)  # the router's last tally reaches the metrics port
            else:
                self.sleep(min(interval_s, max(0.0, end - now)))
            current = RolloutState.load(self.state_path)
            if current is None or current.phase != "canary" or current.candidate != candidate:
                return None
            text = self.client.metrics()
            ok_n, fail_n = calls_between(calls_before, call_counts(text, state.encoder), candidate)
            # A native backend's failures also show in Triton's statistics (a Python-based
            # one's do not); the router may have seen the same ones: take the larger count.
            stats_after = self.client.version_stats(state.encoder)
            triton_fail = stats_after.get(candidate, {}).get("fail", 0) - stats_before.get(candidate, {}).get("fail", 0)
            fail_n = max(fail_n, int(triton_fail))
            candidate_p99 = stable_p99 = None
            if final:
                hist_after = latency_buckets(text, state.encoder)
                candidate_p99, _ = p99_between(hist_before, hist_after, candidate)
                stable_p99, seen = p99_between(hist_before, hist_after, state.stable)
                if stable_p99 is not None and seen >= limits.min_requests:
                    state.baseline_p99_ms = stable_p99  # the stable side of this very window
                else:  # no stable traffic at 100 %: the last step's stable P99
                    stable_p99 = state.baseline_p99_ms
            verdict = judge(ok_n, fail_n, candidate, stable_p99, candidate_p99, limits, final)
            if not verdict.ok:
                return verdict
            if not final:
                continue
            if verdict.judged:
                return verdict
            # The dwell is over and too few calls reached the new version to judge it.
            if limits.allow_unjudged:
                self.say(f"rollout: WARNING: step {state.step + 1} passes UNJUDGED (--allow-unjudged): {verdict.reason}")
                return Verdict(True, False, f"{verdict.reason}; passed unjudged (--allow-unjudged)", verdict.figures)
            waited = self.clock() - end
            if self.clock() >= deadline:
                return Verdict(
                    False,
                    False,
                    f"{verdict.reason} after the {state.dwell_s:.0f} s dwell and {waited:.0f} s more waiting "
                    f"for traffic (--traffic-timeout {limits.traffic_timeout_s:.0f} s): a step is not "
                    f"passed on no evidence (--allow-unjudged passes such steps)",
                    verdict.figures,
                )
            if not waiting:
                waiting = True
                self.say(
                    f"rollout: step {state.step + 1}: {verdict.reason}; waiting up to "
                    f"{limits.traffic_timeout_s:.0f} s for traffic"
                )
            self.sleep(max(0.0, min(interval_s, deadline - self.clock()) - FLUSH_WAIT_S))

    def _abort(self, state: RolloutState, reason: str, figures: dict | None = None) -> int:
        self.say(f"rollout: ABORT: {reason}; rolling back to version {state.stable}")
        self._rollback(state, "aborted", reason, figures or {})
        return 1

    # -- rollback / finish
    def _rollback(self, state: RolloutState, phase: str, reason: str, figures: dict) -> None:
        candidate = state.candidate
        if self.client.ready(state.router):  # an abort before the router was in front has none
            self._apply_weights(state, {state.stable: 100}, f"rollback to version {state.stable}")
        else:
            state.weights = {state.stable: 100}
        state.phase, state.reason, state.candidate, state.step = phase, reason, None, -1
        state.event(phase, version=candidate, reason=reason, **figures)
        self._save(state)
        if candidate is not None and candidate != state.stable:
            try:
                set_versions(self.client, state.encoder, [state.stable])
            except RepositoryError as exc:  # the weights are back already; unloading can be retried
                self.say(f"rollout: version {candidate} could not be unloaded ({exc}); traffic is on {state.stable}")
            else:
                state.loaded = [state.stable]
                self._save(state)
        self._unroute(state)

    def rollback(self) -> int:
        state = self.state()
        if state.phase not in ("canary", "rolled_out"):
            raise UsageError(
                f"nothing to roll back: the state is {state.phase!r} with version {state.stable} serving "
                f"(after `finish` the old version is unloaded; roll it out again instead)"
            )
        self.say(f"rollout: rolling back version {state.candidate} -> {state.stable}")
        self._rollback(state, "rolled_back", "rollback requested", {})
        self.say(f"rollout: version {state.stable} serves 100 %")
        return 0

    def finish(self, force: bool = False, wait: bool = False) -> int:
        state = self.state()
        if state.phase != "rolled_out":
            raise UsageError(f"nothing to finish: the state is {state.phase!r} (finish follows a completed rollout)")
        assert state.completed_at is not None  # rolled_out is written with its completion time
        left = state.completed_at + state.rollback_window_s - time.time()
        if left > 0 and wait and not force:
            self.say(f"rollout: waiting {left:.0f} s for the rollback window to close")
            while left > 0:
                self.sleep(min(left, 5.0))
                state = self.state()
                if state.phase != "rolled_out":  # rolled back from another shell meanwhile
                    self.say(f"rollout: the state changed to {state.phase!r}; nothing to finish")
                    return 1
                assert state.completed_at is not None  # rolled_out, as above
                left = state.completed_at + state.rollback_window_s - time.time()
        if left > 0 and not force:
            raise UsageError(
                f"the rollback window is open for {left:.0f} s more (version {state.stable} kept for "
                f"{state.rollback_window_s:.0f} s); run finish after it, or pass --wait or --force"
            )
        old, new = state.stable, state.candidate
        assert new is not None  # rolled_out: the candidate serves 100 %
        self._apply_weights(state, {new: 100}, f"finish: version {new} alone")
        set_versions(self.client, state.encoder, [new])
        for lane in lanes_of(self.client, state.encoder):  # the interactive lane follows (it served the stable one)
            try:
                set_versions(self.client, lane, [new])
                self.say(f"rollout: {lane} serves version {new}")
            except RepositoryError as exc:  # e.g. published elsewhere: the lane has no folder {new}
                self.say(f"rollout: {lane} still serves its version ({exc}); it follows at the next server start")
        state.stable, state.candidate, state.loaded, state.phase, state.step = new, None, [new], "finished", -1
        state.event("finished", unloaded=old, serving=new)
        self._save(state)
        self._unroute(state)
        self.say(f"rollout: version {old} unloaded; version {new} serves alone")
        return 0

    def status(self) -> dict:
        state = self.state()
        info: dict[str, Any] = {"state_file": str(self.state_path), **asdict(state)}
        info["weights"] = format_weights(state.weights)
        info["history"] = state.history[-5:]
        try:
            routed = self._routed_now(state.entry, state.encoder, state.router)
            info["form"] = describe_form(ROUTED if routed else "direct", state.encoder, state.router)
            if routed:
                info["served_weights"] = format_weights(served_weights(self.client, state.router))
            stats = self.client.version_stats(state.encoder)
            info["versions"] = {
                v: {"ready": self.client.ready(state.encoder, v), **{k: int(x) for k, x in s.items() if k != "success_ns"}}
                for v, s in sorted(stats.items())
            }
        except RepositoryError as exc:
            info["server"] = f"unreachable: {exc}"
        if state.phase == "rolled_out" and state.completed_at:
            info["rollback_window_left_s"] = max(0, round(state.completed_at + state.rollback_window_s - time.time()))
        return info


def publish(
    repository: Path, encoder: str = ENCODER, source: Path | None = None, version: int | None = None, link: bool = False
) -> int:
    """Copy an export (``source``, default the encoder's version folder 1, where ``python -m
    export`` writes) into the next version folder (or ``version``); returns the version."""
    model_dir = Path(repository) / encoder
    if not model_dir.is_dir():
        raise UsageError(f"{model_dir} does not exist: --repository must be a model repository with {encoder}/")
    existing = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    version = version if version is not None else (max(existing) + 1 if existing else 1)
    if version < 1:
        raise UsageError(f"--version must be >= 1, got {version}")
    target = model_dir / str(version)
    if target.exists():
        raise UsageError(f"version {version} exists already ({target}); versions are immutable, publish a new one")
    source = Path(source) if source is not None else model_dir / "1"
    files = sorted({p for pattern in VERSION_FILES for p in source.glob(pattern)})
    if not any(p.suffix in (".onnx", ".plan") for p in files):
        raise UsageError(f"{source} holds no model file ({', '.join(VERSION_FILES)}); run `python -m export` first")
    tmp = model_dir / f".{version}.publishing"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for p in files:
        (os.link if link else shutil.copy2)(p, tmp / p.name)
    os.replace(tmp, target)  # the folder appears complete or not at all
    from export.lanes import render_all

    render_all(Path(repository))  # the priority-class lanes get the folder too (docs/priority-classes.md)
    return version


def lanes_of(client: AnyRepositoryClient, encoder: str) -> list[str]:
    """The loaded priority-class lanes of ``encoder`` (its ``lanes`` parameter, export/lanes.py)."""
    from export.lanes import declared_lanes

    raw = client.config(encoder).get("parameters", {}).get("lanes", {}).get("string_value", "")
    names = [lane.name for lane in declared_lanes(encoder, f'key: "lanes" value: {{ string_value: "{raw}" }}')] if raw else []
    out = []
    for n in names:
        try:
            if client.ready(n):
                out.append(n)
        except RepositoryError:
            pass
    return out


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=os.environ.get("TRITON_HTTP_URL", "127.0.0.1:8000"), help="Triton's HTTP host:port")
    p.add_argument("--metrics-url", default=None, help="default http://<host>:8002/metrics")
    p.add_argument(
        "--token", default=None, help="repository token (default $TRITON_REPOSITORY_TOKEN or .triton/repository-token)"
    )
    p.add_argument("--state-file", type=Path, default=Path(os.environ.get(STATE_ENV) or DEFAULT_STATE_FILE))
    p.add_argument(
        "--model-repository",
        type=Path,
        default=ROOT / "model_repository",
        help="the server's model repository, for the router's config when it is not loaded",
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="load, warm, check and step a version up to 100 %%")
    s.add_argument("version", type=int)
    s.add_argument("--steps", default="10,50,100", help="percent per step, ending at 100 (default 10,50,100)")
    s.add_argument("--dwell", type=float, default=DEFAULT_DWELL_S, help=f"seconds per step (default {DEFAULT_DWELL_S:.0f})")
    s.add_argument("--check-interval", type=float, default=5.0, help="seconds between checks within a step")
    s.add_argument(
        "--rollback-window", type=float, default=DEFAULT_WINDOW_S, help="seconds the old version stays loaded (default 900)"
    )
    t = Thresholds()
    s.add_argument(
        "--max-error-rate",
        type=float,
        default=t.max_error_rate,
        help=f"abort above this share of failed calls of the new version (default {t.max_error_rate})",
    )
    s.add_argument(
        "--p99-ratio",
        type=float,
        default=t.p99_ratio,
        help=f"abort when the new P99 exceeds this x the stable P99 ... (default {t.p99_ratio})",
    )
    s.add_argument(
        "--p99-slack-ms",
        type=float,
        default=t.p99_slack_ms,
        help=f"... and the stable P99 + this many ms (default {t.p99_slack_ms:g})",
    )
    s.add_argument(
        "--min-requests",
        type=int,
        default=t.min_requests,
        help=f"calls of the new version before anything is judged (default {t.min_requests})",
    )
    s.add_argument(
        "--traffic-timeout",
        type=float,
        default=t.traffic_timeout_s,
        help="seconds a step waits after its dwell for --min-requests calls of the new version, then "
        f"fails and rolls back (default {t.traffic_timeout_s:.0f})",
    )
    s.add_argument(
        "--allow-unjudged",
        action="store_true",
        help="pass a step that saw fewer than --min-requests calls (a warning is printed) instead of "
        "rolling back: promotes the version without evidence",
    )
    sub.add_parser("status", help="print the state and the server's per-version figures (JSON)")
    sub.add_parser("rollback", help="100 %% back to the previous version now")
    f = sub.add_parser("finish", help="unload the old version after the rollback window")
    f.add_argument("--force", action="store_true", help="finish before the window is over")
    f.add_argument("--wait", action="store_true", help="wait for the window to close, then finish")
    pub = sub.add_parser("publish", help="copy the exported model into the next version folder")
    pub.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    pub.add_argument("--source", type=Path, help="folder with the exported files (default text_encoder/1)")
    pub.add_argument("--version", type=int, help="version number (default: the next free one)")
    pub.add_argument("--link", action="store_true", help="hard-link instead of copying (same file system)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        if args.command == "publish":
            version = publish(args.repository, source=args.source, version=args.version, link=args.link)
            print(f"rollout: published text_encoder version {version}; roll it out with `rollout start {version}`")
            return 0
        host = args.url.split("://")[-1].rsplit(":", 1)[0]
        # serve-cluster's front door: every replica, each step judged on all their traffic.
        client = connect(args.url, token=args.token, metrics_url=args.metrics_url or f"http://{host}:8002/metrics")
        if isinstance(client, ReplicatedRepositoryClient):
            print(f"rollout: a cluster of {len(client.replicas)} replicas: {', '.join(client.names)}", flush=True)
        rollout = Rollout(client, args.state_file, say=lambda m: print(m, flush=True), repository=args.model_repository)
        if args.command == "start":
            try:
                steps = [int(s) for s in args.steps.split(",") if s.strip()]
            except ValueError:
                raise UsageError(f"--steps must be comma-separated integers, got {args.steps!r}") from None
            check_steps(steps)
            thresholds = Thresholds(
                args.max_error_rate,
                args.p99_ratio,
                args.p99_slack_ms,
                args.min_requests,
                traffic_timeout_s=args.traffic_timeout,
                allow_unjudged=args.allow_unjudged,
            ).check()
            return rollout.start(args.version, steps, args.dwell, thresholds, args.check_interval, args.rollback_window)
        if args.command == "status":
            print(json.dumps(rollout.status(), indent=2, default=str))
            return 0
        if args.command == "rollback":
            return rollout.rollback()
        if args.command == "finish":
            return rollout.finish(force=args.force, wait=args.wait)
    except (UsageError, RoutingError) as exc:
        print(f"rollout: {exc}", file=sys.stderr)
        return 2
    except RepositoryError as exc:
        print(f"rollout: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
