"""The supervision loop's lock (server/deployment_loop.py) without a server: stand-ins for a
replica's tritonserver and a gateway whose start or stop blocks until released show that readers
(the repository door's address lookups, cluster.json) do not wait for them, that a member busy
being stopped is not started meanwhile, and that a stop during a gateway's start stops it after."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import server.deployment_loop as deployment_loop
from server.deployment import Deployment, DeploymentOptions
from server.deployment_parts import DOWN, READY, STARTING, STOPPED
from server.gateway import GatewayOptions

PROMPT_S = 2.0  # a reader's lookup while a slow call blocks: at once, with room for a loaded machine
BLOCKED_S = 60.0  # what the stand-ins wait for their release at most


class Blocking:
    """A process stand-in whose start() or stop() blocks until ``release`` is set."""

    def __init__(self, block: str, exited_with: int | None = None):
        self.block, self.entered, self.release = block, threading.Event(), threading.Event()
        self.calls: list[str] = []
        self.log_path = Path("stand-in.log")
        self.process: subprocess.Popen | None = None
        if exited_with is not None:
            self.process = subprocess.Popen(["sh", "-c", f"exit {exited_with}"])
            self.process.wait()

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.block:
            self.entered.set()
            assert self.release.wait(BLOCKED_S)

    def start(self, *_args) -> Blocking:
        self._call("start")
        return self

    def stop(self, timeout: float | None = None) -> int | None:
        self._call("stop")
        return None

    def wait_ready(self, timeout: float = 0.0, should_stop=lambda: False) -> None:
        self.calls.append("wait_ready")

    def running(self) -> bool:
        return "start" in self.calls and "stop" not in self.calls

    def status(self, path: str, timeout: float = 2.0) -> int:
        return 0

    def log_tail(self, lines: int = 60) -> str:
        return ""


@pytest.fixture
def pool(tmp_path, monkeypatch):
    monkeypatch.setattr(deployment_loop, "prepare_repository", lambda *args: None)
    return Deployment(DeploymentOptions(replicas=2, pool=True, workdir=tmp_path, models=("text_embedding",)))


def _in_thread(call) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def _prompt(call):
    """``call()``'s result, failing the test when it waits for the lock."""
    out: list = []
    reader = _in_thread(lambda: out.append(call()))
    reader.join(PROMPT_S)
    assert not reader.is_alive(), f"a reader waited more than {PROMPT_S} s for the supervision lock"
    return out[0]


def test_readers_do_not_wait_for_a_replica_restart_and_a_busy_replica_is_not_started_twice(pool, monkeypatch):
    restarted = Blocking("start")
    monkeypatch.setattr(deployment_loop, "TritonServer", lambda *args, **kwargs: restarted)
    loop, (dead, fine) = pool.loop, pool.replicas
    fine.server, fine.state, fine.starts = Blocking("none"), READY, 1
    # A replica whose tritonserver exited: its stop (the reaping of its process group) blocks.
    dead.server, dead.state, dead.starts, dead.in_door = Blocking("stop", exited_with=3), READY, 1, True
    stopping = dead.server
    ticking = _in_thread(loop._tick)
    assert stopping.entered.wait(BLOCKED_S)
    states = {a.name: a.state for a in _prompt(pool.replica_addresses)}
    assert states == {"replica 0": DOWN, "replica 1": READY} and loop.busy(dead)
    assert [r["state"] for r in _prompt(pool.describe)["replicas"]] == [DOWN, READY]
    # Down, its restart time long past, but being stopped: not started now.
    assert not loop._start_replica(dead, time.monotonic() + 3600) and restarted.calls == []
    stopping.release.set()
    ticking.join(BLOCKED_S)
    assert dead.exit_codes == [3] and "replica 0: tritonserver exited (code 3)" in (loop.failure or "")
    assert not loop.busy(dead) and dead.state == DOWN and dead.restarts == 0

    # Its restart: the new tritonserver's start blocks; the readers see it starting meanwhile.
    dead.next_start = 0.0
    ticking = _in_thread(loop._tick)
    assert restarted.entered.wait(BLOCKED_S)
    assert _prompt(pool.replica_addresses)[0].state == STARTING and loop.busy(dead)
    assert not loop._start_replica(dead, time.monotonic() + 3600)  # no second start of it
    restarted.release.set()
    ticking.join(BLOCKED_S)
    assert dead.server is restarted and (dead.starts, dead.restarts) == (2, 1) and not loop.busy(dead)
    assert dead.waiter is not None
    dead.waiter.join(BLOCKED_S)
    assert dead.state == READY and restarted.calls == ["start", "wait_ready"]
    assert (tmp := pool.state_path).is_file() and '"restarts": 1' in tmp.read_text()


def test_a_stop_during_a_gateways_start_stops_it_once_started(tmp_path, monkeypatch):
    gateway = Blocking("start")
    monkeypatch.setattr(deployment_loop, "GatewayProcess", lambda options: gateway)
    deployment = Deployment(DeploymentOptions(workdir=tmp_path, gateway=GatewayOptions("", port=18080)))
    loop, (member,), (replica,) = deployment.loop, deployment.gateways, deployment.replicas
    replica.state = READY  # its tritonserver never started: nothing for the tick to do
    loop._thread = starting = _in_thread(loop._tick)
    assert gateway.entered.wait(BLOCKED_S)
    assert _prompt(deployment.describe)["gateways"][0]["state"] == STARTING
    stopper = _in_thread(loop.stop_gateways)
    stopper.join(0.5)
    assert stopper.is_alive() and gateway.calls == ["start"]  # it waits for the start to end
    gateway.release.set()
    stopper.join(BLOCKED_S)
    starting.join(BLOCKED_S)
    assert gateway.calls == ["start", "stop"] and member.state == STOPPED and member.starts == 1
    assert not loop._start_gateway(member, time.monotonic() + 3600)  # none after a stop


def test_a_stop_during_a_replica_start_waits_for_it_then_stops_the_replica(pool):
    starting, (first, second) = Blocking("start"), pool.replicas
    first.server = starting
    second.state = READY  # its tritonserver never started: nothing for the loop to do
    pool.loop.start()
    assert starting.entered.wait(BLOCKED_S)
    assert _prompt(pool.replica_addresses)[0].state == STARTING
    stopping = _in_thread(pool.loop.stop)
    stopping.join(0.5)
    assert stopping.is_alive()  # the loop's thread owns the replica: it ends the start first
    starting.release.set()
    stopping.join(BLOCKED_S)
    assert not stopping.is_alive() and starting.calls[0] == "start" and starting.calls[-1] == "stop"
    assert [r.state for r in pool.replicas] == [STOPPED, STOPPED]


def test_a_tick_in_progress_at_shutdown_does_not_reload_the_front_door(tmp_path, monkeypatch):
    """The gateways marked stopped by stop_gateways change who is wanted in the front door; a
    tick that was stopping a replica meanwhile ends without reloading nginx, which the
    deployment stops next."""
    monkeypatch.setattr(deployment_loop, "prepare_repository", lambda *args: None)
    deployment = Deployment(
        DeploymentOptions(
            replicas=2, pool=True, workdir=tmp_path, models=("text_embedding",), gateway=GatewayOptions("", port=18080)
        )
    )
    reloads: list = []
    deployment.doors = SimpleNamespace(reload=lambda *args: reloads.append(args), reloads=0)  # type: ignore[assignment]
    loop, (dead, fine), (gateway,) = deployment.loop, deployment.replicas, deployment.gateways
    fine.server, fine.state, fine.starts, fine.in_door = Blocking("none"), READY, 1, True
    dead.server, dead.state, dead.starts, dead.in_door = Blocking("stop", exited_with=3), READY, 1, True
    gateway.process, gateway.state = Blocking("none"), READY  # type: ignore[assignment]
    loop.rendered = loop.wanted()
    stopping = dead.server
    loop._thread = ticking = _in_thread(loop._tick)
    assert stopping.entered.wait(BLOCKED_S)
    loop.stop_gateways()
    assert gateway.state == STOPPED
    stopping.release.set()
    ticking.join(BLOCKED_S)
    assert not ticking.is_alive() and reloads == []
