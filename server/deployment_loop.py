"""A deployment's supervision loop (server/deployment.py): one thread starts the replicas and the
gateways and, when the options ask for it, restarts a dead one with a bounded backoff; it starts
a new gRPC door when one exits, restarts the deployment's own Redis, and keeps a pool's front
door's upstream list in step with who is ready. A second thread runs the health checks, so that
a hung replica's 2-s timeouts do not delay the loop's tick."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from server.deployment_parts import DOWN, READY, STARTING, STOPPED, Gateway, Replica
from server.frontdoor import FrontDoorError
from server.gateway import GatewayProcess
from server.models import closure, with_dependencies
from server.process import ServerError, TritonServer
from server.repository_prep import prepare as prepare_repository
from server.supervisor import http_status

if TYPE_CHECKING:
    from server.deployment import Deployment

log = logging.getLogger(__name__)

FAILED_START = "failed-start"
NEVER = float("inf")


class Supervision:
    """The loop over one deployment's members. ``lock`` guards their records (states, the
    upstream list as rendered) and is held only to read or change them: the slow calls
    (starting or stopping a process, reloading nginx, waiting for readiness) are made outside
    it, the member marked busy meanwhile, so that the repository door's address lookups and the
    other readers never wait for a replica's restart, and nothing else starts or stops a busy
    member (``stop_gateways`` waits for a gateway's start or stop in progress to end)."""

    def __init__(self, deployment: Deployment):
        self.d = deployment
        self.options = deployment.options
        self.lock = threading.RLock()
        self._idle = threading.Condition(self.lock)  # notified when a member's slow call ends
        self._busy: set[tuple[str, int]] = set()  # ("replica" or "gateway", index) in a slow call
        self._stop = threading.Event()
        # Set by stop(), after the deployment stopped the doors: the replicas are stopped only
        # then. A tritonserver told to stop while nginx still holds a keep-alive connection to it
        # waits a whole second for that connection ("Found 1 HTTP service connections").
        self._release_replicas = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = False
        self.rendered: tuple[bool, ...] | None = None  # who is in a pool's front door, as nginx has it
        self._states_written: tuple = ()
        self.redis_restarts = 0
        self._redis_next_start = 0.0
        self.failure: str | None = None  # what died and is not restarted (restart off)
        self._probed: list[str] = self._served_models()  # what the health checks ask each pooled replica

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        self.started = True
        self._thread = threading.Thread(target=self._supervise, name="deployment-supervisor", daemon=True)
        self._thread.start()
        threading.Thread(target=self._health_checks, name="deployment-health", daemon=True).start()

    def event(self, message: str) -> None:
        try:
            self.d.on_event(message)
        except Exception:  # a printer must not stop the loop
            log.exception("deployment event printer failed")

    def wanted(self) -> tuple[bool, ...]:
        """Who is in a pool's front door: the replicas, then the gateways (nobody else's)."""
        if not self.options.pool:
            return ()
        return tuple(r.in_door for r in self.d.replicas) + tuple(g.state == READY for g in self.d.gateways)

    @staticmethod
    def _key(member: Replica | Gateway) -> tuple[str, int]:
        return ("replica" if isinstance(member, Replica) else "gateway", member.index)

    def busy(self, member: Replica | Gateway) -> bool:
        """A start or a stop of ``member`` is in progress (outside the lock)."""
        with self.lock:
            return self._key(member) in self._busy

    def _unlocked(self, member: Replica | Gateway, call: Callable[[], object]) -> Exception | None:
        """``call()`` for ``member``, which the caller marked busy holding the lock (with the
        decision that led to it), made without the lock; the error it raised, if any. The caller
        then records the outcome under the lock, where it also clears the mark (``_done``)."""
        assert self._key(member) in self._busy
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the caller records it (a failed start is retried like a crash)
            return exc
        except BaseException:
            self._done(member)
            raise
        return None

    def _done(self, member: Replica | Gateway) -> None:
        with self.lock:
            self._busy.discard(self._key(member))
            self._idle.notify_all()

    # --- replicas ---------------------------------------------------------------------------
    def _start_replica(self, replica: Replica, now: float) -> bool:
        """From the loop's thread (the replica is tied to it), when its start is due (else False):
        the process starts outside the lock, the replica marked busy and starting."""
        o = self.options
        with self.lock:
            due = replica.state == DOWN and now >= replica.next_start and self._key(replica) not in self._busy
            if not due or self._stop.is_set():
                return False
            if replica.starts:
                replica.restarts += 1
                replica.server = TritonServer(replica.options, echo=self.d.echo)
            replica.starts += 1
            replica.state = STARTING
            replica.health_misses = 0
            server = replica.server
            assert server is not None
            self._busy.add(self._key(replica))
        # Before each (re)start: the rollout state may have moved on since the last one.
        error = self._unlocked(replica, lambda: server.start(prepare_repository(o.model_repository, o.models, o.rollout_state)))
        with self.lock:
            self._done(replica)
            if error is not None:
                self._failed(replica, f"did not start: {error}")
                return True

        def wait() -> None:
            try:
                server.wait_ready(
                    timeout=o.ready_timeout, should_stop=lambda: self._stop.is_set() or server is not replica.server
                )
            except ServerError as exc:
                with self.lock:
                    if replica.server is server and not self._stop.is_set():
                        if not replica.ready_since and replica.starts == 1:
                            replica.error = f"{exc}\n{exc.log_tail}"
                        self.event(f"replica {replica.index}: not ready ({exc}); log {replica.log_path}")
                        replica.state = FAILED_START
                return
            with self.lock:
                if replica.server is server and replica.state == STARTING:
                    replica.state = READY
                    replica.in_door = True
                    replica.ready_since = time.monotonic()

        replica.waiter = threading.Thread(target=wait, name=f"replica-{replica.index}-ready", daemon=True)
        replica.waiter.start()
        return True

    def _failed(self, member: Replica | Gateway, why: str) -> None:
        """Mark a replica or a gateway down and schedule its restart with backoff (with restart
        off: never, and the deployment's failure says what died). A first start that failed is
        the member's ``error`` too: wait_ready raises it. Called holding the lock."""
        kind = "replica" if isinstance(member, Replica) else "gateway"
        child = member.server if isinstance(member, Replica) else member.process
        message = f"{kind} {member.index}: {why}\n{child.log_tail() if child is not None else ''}"
        if member.starts == 1 and not member.ready_since and member.error is None:
            member.error = message
        stayed_ready_s = time.monotonic() - member.ready_since if member.ready_since else 0.0
        member.state = DOWN
        member.ready_since = 0.0
        if not self.options.restart:
            member.next_start = NEVER
            self.failure = self.failure or message
            self.event(f"{kind} {member.index}: {why}")
            return
        backoff = self.options.backoff
        if stayed_ready_s >= backoff.reset_after_s:
            member.failures_in_row = 0
        member.failures_in_row += 1
        delay = backoff.delay(member.failures_in_row)
        member.next_start = time.monotonic() + delay
        self.event(f"{kind} {member.index}: {why}; restart {member.restarts + 1} in {delay:.0f} s")

    def _watch_ready(self, replica: Replica) -> None:
        server = replica.server

        def wait() -> None:
            while not self._stop.is_set() and replica.server is server and replica.state == STARTING:
                if self._replica_healthy(replica):
                    with self.lock:
                        if replica.server is server and replica.state == STARTING:
                            replica.state = READY
                            replica.in_door = True
                            replica.health_misses = 0
                    return
                time.sleep(0.5)

        replica.waiter = threading.Thread(target=wait, name=f"replica-{replica.index}-health", daemon=True)
        replica.waiter.start()

    def _check_replica(self, r: Replica) -> None:
        """A replica whose tritonserver exited or did not become ready is marked down (for the
        readers at once), stopped outside the lock, then given its restart time; one that fails
        its health checks leaves the front door until it answers again."""
        o = self.options
        tell_door = False
        with self.lock:
            server = r.server
            if self._key(r) in self._busy or server is None:
                return
            starting = r.state == STARTING and not r.ready_since and r.waiter is not None and r.waiter.is_alive()
            if r.state in (READY, STARTING) and server.process is not None and not r.alive():
                if starting:
                    return  # its start's waiter sees the exit, and says why with the log's end
                code = server.process.returncode
                r.exit_codes.append(code)
                why, grace = f"tritonserver exited (code {code})", 0.0
            elif r.state == FAILED_START:
                why, grace = "failed to become ready", 2.0
            elif r.state == READY and r.health_misses >= o.health_failures:
                r.state = STARTING  # back in once ready again
                r.in_door = False
                self._watch_ready(r)
                why, misses = "", r.health_misses
            else:
                return
            if why:
                r.state = DOWN
                self._busy.add(self._key(r))
                tell_door = o.pool and r.in_door and self.d.doors is not None
        if not why:
            self.event(
                f"replica {r.index}: a served model was not ready {misses} times in a row; "
                "out of the front door until it answers again"
            )
            return

        if tell_door:
            # At once, not at the tick's end (after this stop and any restarts): the gRPC door takes
            # a call that nginx reset on this replica as lost only while this file exists, and it
            # waits 0.5 s for it (server/grpc_door.py); the front-door sync keeps or removes it.
            self.d.replica_starting_file.touch()

        def stop() -> None:
            if grace == 0.0 and server.process is not None:
                try:  # its python backend stubs and anything else in its process group
                    os.killpg(server.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            # Reaps it, stops its watchdog and removes its shared-memory regions: the next start
            # is a new TritonServer with a new prefix, so nothing else would.
            server.stop(timeout=grace)

        error = self._unlocked(r, stop)
        with self.lock:
            self._done(r)
            if grace:
                r.exit_codes.append(server.process.returncode if server.process else None)
            self._failed(r, why)
        if error is not None:
            log.error("replica %d did not stop cleanly: %s", r.index, error)

    def _tick_replicas(self, now: float) -> None:
        for r in self.d.replicas:
            self._check_replica(r)
        for r in self.d.replicas:
            if not self._start_replica(r, now):
                continue
            if r.starts > 1:
                self.event(f"replica {r.index}: restarted (pid {r.pid}); back in the front door once ready")
            self.d.write_state()

    # --- gateways ---------------------------------------------------------------------------
    def _start_gateway(self, gateway: Gateway, now: float) -> bool:
        """From the loop's thread (the gateway is tied to it, as the replicas are), when its start
        is due (else False). Never once stopping: stop_gateways sets that, then marks the
        gateways stopped under the lock, so no start begins after it."""
        with self.lock:
            due = gateway.state == DOWN and now >= gateway.next_start and self._key(gateway) not in self._busy
            if not due or self._stop.is_set():
                return False
            if gateway.starts:
                gateway.restarts += 1
            process = gateway.process = GatewayProcess(self.d.gateway_options(gateway))
            gateway.starts += 1
            gateway.state = STARTING
            gateway.health_misses = 0
            self._busy.add(self._key(gateway))
        error = self._unlocked(gateway, process.start)
        with self.lock:
            self._done(gateway)
            if error is not None:
                self._failed(gateway, f"did not start: {error}")
            else:
                self._watch_gateway(gateway)
        return True

    def _watch_gateway(self, gateway: Gateway) -> None:
        """Until its /health/ready answers 200 (it is up and sees Triton's models ready)."""
        process, deadline = gateway.process, time.monotonic() + self.options.ready_timeout
        assert process is not None  # _start_gateway has just started it

        def wait() -> None:
            while not self._stop.is_set() and gateway.process is process and gateway.state == STARTING:
                if process.status("/health/ready") == 200:
                    with self.lock:
                        if gateway.process is process and gateway.state == STARTING:
                            gateway.state = READY
                            gateway.health_misses = 0
                            gateway.ready_since = gateway.ready_since or time.monotonic()
                    return
                if time.monotonic() > deadline:
                    with self.lock:
                        if gateway.process is process and gateway.state == STARTING:
                            gateway.state = FAILED_START
                    return
                time.sleep(0.2)

        threading.Thread(target=wait, name=f"gateway-{gateway.index}-ready", daemon=True).start()

    def _check_gateway(self, g: Gateway) -> None:
        """As _check_replica, for a gateway: one that exited or did not become ready is marked
        down and stopped outside the lock; one failing /health leaves the front door."""
        o = self.options
        with self.lock:
            process = g.process
            if self._key(g) in self._busy or process is None or self._stop.is_set():
                return  # stopping: stop_gateways stops it
            if g.state in (READY, STARTING) and not g.alive():
                code = process.process.returncode if process.process else None
                g.exit_codes.append(code)
                why, grace = f"exited (code {code})", 0.0
            elif g.state == FAILED_START:
                why, grace = f"/health/ready not 200 within {o.ready_timeout:.0f} s", 2.0
            elif g.state == READY and g.health_misses >= o.health_failures:
                g.state = STARTING
                self._watch_gateway(g)
                why, misses = "", g.health_misses
            else:
                return
            if why:
                g.state = DOWN
                pid = g.pid
                self._busy.add(self._key(g))
        if not why:
            self.event(f"gateway {g.index}: /health failed {misses} times; out of the front door until it answers again")
            return

        def stop() -> None:
            if grace == 0.0 and pid is not None:
                try:  # anything else in its process group
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.stop(timeout=grace)  # closes its log

        error = self._unlocked(g, stop)
        with self.lock:
            self._done(g)
            if grace:
                g.exit_codes.append(process.process.returncode if process.process else None)
            self._failed(g, why)
        if error is not None:
            log.error("gateway %d did not stop cleanly: %s", g.index, error)

    def _tick_gateways(self, now: float) -> None:
        for g in self.d.gateways:
            self._check_gateway(g)
        for g in self.d.gateways:
            if not self._start_gateway(g, now):
                continue
            if g.starts > 1:
                self.event(f"gateway {g.index}: restarted (pid {g.pid}); back in the front door once ready")
            self.d.write_state()

    def _gateways_busy(self) -> bool:
        return any(kind == "gateway" for kind, _ in self._busy)

    def stop_gateways(self) -> list[GatewayProcess]:
        """Stop the loop and every gateway, side by side (their in-flight requests drain); a
        gateway's start or stop in progress ends first."""
        self._stop.set()
        with self.lock:  # after this, the loop starts no gateway (it checks _stop under the lock)
            while self._gateways_busy() and self._thread is not None and self._thread.is_alive():
                self._idle.wait(0.5)
            gateways = [(g, g.process) for g in self.d.gateways if g.process is not None]
            for g, _ in gateways:  # stopping, not exited: the loop neither restarts nor stops them again
                g.state = STOPPED
        stoppers = [threading.Thread(target=process.stop, daemon=True) for _, process in gateways]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        return [process for _, process in gateways]

    # --- the rest ---------------------------------------------------------------------------
    def _tick_redis(self, now: float) -> None:
        """The deployment's own redis-server (the replicas' L2 cache, a pool's gateways' shared
        rate limit) is restarted on the same port when it exited; meanwhile the replicas serve
        from L1 and compute, and the rate limit fails open or closed as configured. Its contents
        are gone: a cache refills. Only this thread restarts it, without the lock."""
        redis = self.d.redis
        if redis is None or redis.process is None or redis.process.poll() is None or self._stop.is_set():
            return
        if now < self._redis_next_start:
            return
        code = redis.process.returncode
        self.redis_restarts += 1
        try:
            redis.start()
        except Exception as exc:  # noqa: BLE001 - RedisError or OSError: tried again after a pause
            self._redis_next_start = now + 5.0
            self.event(f"redis: exited (code {code}); restart failed ({exc}); trying again in 5 s")
            return
        self.event(f"redis: exited (code {code}); restarted on port {redis.port} (pid {redis.process.pid})")
        self.d.write_state()

    def _tick_grpc_door(self) -> None:
        """A gRPC door holds no state: when it exits, a new one takes the port at once. In front
        of one tritonserver, not while that one is down too: whoever starts it again starts the
        deployment again, door and all."""
        doors = self.d.doors
        if doors is None or self._stop.is_set():
            return
        if not self.options.pool and not self.d.replicas[0].alive():
            return
        what = doors.restart_grpc_door(time.monotonic(), self.options.backoff)
        if what is not None:
            self.event(what)

    def _sync_front_door(self) -> None:
        """Re-render a pool's upstream list and reload nginx when a replica went in or out (and
        write the state file when only the states changed: a restarted replica that is ready
        again needs no reload, it never left the list). The list is read under the lock, nginx
        reloaded outside it. Not once stopping: the gateways stop_gateways marked stopped would
        leave the list of an nginx that the deployment stops next (a tick in progress then)."""
        if not self.options.pool or self.d.doors is None or self._stop.is_set():
            return
        replicas, gateways = self.d.replicas, self.d.gateways
        with self.lock:
            wanted, rendered = self.wanted(), self.rendered
            states = tuple(r.state for r in replicas) + tuple(g.state for g in gateways)
            changed, self._states_written = states != self._states_written, states
            # The gRPC door resends NOT_FOUND while a listed replica is not ready (server/grpc_door.py).
            starting = any(r.in_door and r.state != READY for r in replicas)
            upstreams, gateway_door = [r.upstream() for r in replicas], self.d.gateway_door()
        if changed:
            if starting:
                self.d.replica_starting_file.touch()
            else:
                self.d.replica_starting_file.unlink(missing_ok=True)
            if wanted == rendered:
                self.d.write_state()
        if wanted == rendered:
            return
        try:
            self.d.doors.reload(upstreams, gateway_door)
        except FrontDoorError as exc:
            self.event(f"front door: reload failed ({exc}); keeping the previous upstream list")
            return
        with self.lock:
            self.rendered = wanted
        before = rendered or ()
        for r, was, now in zip(replicas, before, wanted):
            if was != now:
                self.event(f"replica {r.index}: {'in' if now else 'out of'} the front door ({r.address}, pid {r.pid})")
        for g, was, now in zip(gateways, before[len(replicas) :], wanted[len(replicas) :]):
            if was != now:
                self.event(f"gateway {g.index}: {'in' if now else 'out of'} the front door ({g.address}, pid {g.pid})")
        self.d.write_state()

    def _tick(self) -> None:
        """Each step takes the lock for the records it reads or changes, never across a slow call."""
        now = time.monotonic()
        self._tick_replicas(now)
        self._tick_gateways(now)
        self._tick_redis(now)
        self._tick_grpc_door()
        self._sync_front_door()

    def _served_models(self) -> list[str]:
        """What a replica must have ready to stay in a pool's front door: the requested models
        and every model they reach (ensemble steps, BLS targets)."""
        repo = self.options.model_repository
        wanted = with_dependencies(repo, list(self.options.models))
        return sorted({m for model in wanted for m in closure(repo, model)} | set(wanted))

    def _replica_healthy(self, replica: Replica) -> bool:
        """Each served model ready (``/v2/models/<m>/ready``). Not ``/v2/health/ready``: under
        strict readiness tritonserver says not ready while any model loads, so every rollout
        step and repository load would take the replicas out of the front door while the old
        models still serve."""
        if not self._probed:
            return http_status(f"http://{replica.address}/v2/health/ready", timeout=2) == 200
        return all(http_status(f"http://{replica.address}/v2/models/{m}/ready", timeout=2) == 200 for m in self._probed)

    def _health_checks(self) -> None:
        """Its own thread: a hung replica's 2-s timeouts must not delay the loop's tick. A pool's
        replicas (who is in the front door) and every gateway's liveness."""
        o = self.options
        while not self._stop.wait(o.health_interval_s):
            with self.lock:
                due = [(r, r.server) for r in self.d.replicas if r.state == READY and o.pool]
                gateways = [(g, g.process) for g in self.d.gateways if g.state == READY and g.process is not None]
            for r, server in due:
                ok = self._replica_healthy(r)
                with self.lock:
                    if r.server is server and r.state == READY:
                        r.health_misses = 0 if ok else r.health_misses + 1
            # A gateway's liveness only (/health): its readiness follows Triton's, and a replica
            # restart must not take every gateway out.
            for g, process in gateways:
                ok = process.status("/health") == 200
                with self.lock:
                    if g.process is process and g.state == READY:
                        g.health_misses = 0 if ok else g.health_misses + 1

    def _supervise(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:  # the loop must outlive any one mistake
                log.exception("deployment supervision tick failed")
            self._stop.wait(0.2)
        self._release_replicas.wait()  # stop_gateways ended the ticks; stop() ends the replicas
        # The replicas are tied to this thread: stop them here, side by side, before it ends.
        stoppers = [threading.Thread(target=self._stop_replica, args=(r,), daemon=True) for r in self.d.replicas]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()

    def _stop_replica(self, replica: Replica) -> None:
        if replica.server is not None:
            try:
                replica.server.stop()
            except Exception:
                log.exception("replica %d did not stop cleanly", replica.index)
        with self.lock:
            replica.state = STOPPED

    def stop(self) -> None:
        """Stop the loop; it stops the replicas before it ends."""
        self._stop.set()
        self._release_replicas.set()
        if self._thread is not None:
            self._thread.join()
        else:  # never started: nothing was started by it
            with self.lock:
                for r in self.d.replicas:
                    r.state = STOPPED
