"""The stub watchdog: a python backend stub that dies is seen within a second and its model reloaded.

tritonserver 2.51's python backend never restarts a stub that died (a hostile request, an ONNX
Runtime abort, the OOM killer's SIGKILL): every request routed to that instance answers
``Stub process '<instance>' is not healthy`` from then on, while ``/v2/health/ready`` and the
model's ready endpoint keep answering 200. The launcher runs this watchdog beside each
tritonserver. It scans the server's children four times a second; a stub that is gone or a
zombie while its model version is still READY, with no live stub of the same instance and
version in its place, is a death (``StubWatchdog.dead_models``). Then it

1. marks the model, and every loaded model whose requests reach it (an ensemble, a BLS caller),
   unhealthy: one file per model in the health folder, which the front doors read (nginx answers
   the ready endpoints 503, the gRPC door answers ``ModelReady``/``ServerReady`` not ready and
   turns the model's ``INTERNAL`` answers into ``UNAVAILABLE`` meanwhile);
2. reloads the model through the repository API with its own live configuration as an override,
   which makes Triton load fresh instances beside the old ones and swap them in when ready: the
   healthy instances serve until then;
3. clears the marks once the model is ready with live stubs again, and counts all of it in
   ``triton_stub_deaths_total``, ``triton_stub_reloads_total`` and ``triton_model_unhealthy``
   (a Prometheus text file the front door serves on the metrics port at ``/metrics/watchdog``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

STUB_BINARY = "triton_python_backend_stub"
ANY_UNHEALTHY = ".unhealthy"
# After a reload, seconds the replaced model's requests in flight get before its stubs are ended.
REPLACED_GRACE_S = 3.0


@dataclass(frozen=True)
class Stub:
    pid: int
    model: str
    instance: str
    zombie: bool
    version: str = ""  # the version folder of its model file ("" when the path has none)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in (task_dir / tid / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def stub_of(pid: int) -> Stub | None:
    """The stub running as ``pid`` (None: not a stub, or gone). Its command line is
    ``triton_python_backend_stub <model.py path> <shm region> ... <instance name> ...``; the
    model is the folder above the version folder of the model path."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    if not args or not args[0].endswith(STUB_BINARY.encode()):
        return None
    state = stat[stat.rfind(")") + 2 :].split(" ", 1)[0]
    texts = [a.decode(errors="replace") for a in args if a]
    model, instance = model_and_instance(texts)
    folder = Path(texts[1]).parent.name if len(texts) > 1 else ""
    return Stub(pid, model, instance, state in ("Z", "X"), folder if folder.isdigit() else "")


def process_running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed process its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split(" ", 1)[0] not in ("Z", "X")


def model_and_instance(args: list[str]) -> tuple[str, str]:
    """(model, instance) from a stub's arguments."""
    model_path = Path(args[1]) if len(args) > 1 else Path()
    # <repository>/<model>/<version>/model.py, or a Python-based backend's model.py with the
    # model's folder passed further on: the instance name is "<model>_<group>_<index>".
    instance = next(
        (
            a
            for a in args[2:]
            if a.count("_") >= 2 and a.rsplit("_", 2)[-1].isdigit() and a.rsplit("_", 2)[-2].isdigit() and "/" not in a
        ),
        "",
    )
    model = instance.rsplit("_", 2)[0] if instance else model_path.parent.parent.name
    return model, instance


def find_stubs(server_pid: int) -> list[Stub]:
    """The serving stubs of a tritonserver; the short-lived stub a load starts to auto-complete a
    config (instance name AUTOCOMPLETE_STUB) serves nothing and is left out."""
    return [s for s in (stub_of(p) for p in _children(server_pid)) if s is not None and s.instance]


@dataclass
class Counters:
    deaths: dict[str, int] = field(default_factory=dict)
    reloads: dict[str, int] = field(default_factory=dict)
    reload_failures: dict[str, int] = field(default_factory=dict)
    last_recovery_s: dict[str, float] = field(default_factory=dict)


class StubWatchdog:
    """Watches one tritonserver's stubs (a daemon thread); see the module's docstring.

    ``reaches(model)`` gives the loaded models whose requests reach ``model`` (itself included);
    ``reload(model)`` reloads it and returns when it is ready (raises on failure);
    ``loaded()`` the (model, version) pairs READY now."""

    def __init__(
        self,
        server_pid: int,
        health_dir: Path,
        metrics_path: Path | None,
        reload: Callable[[str], None],
        loaded: Callable[[], set[tuple[str, str]]],
        reaches: Callable[[str], Iterable[str]],
        interval: float = 0.25,
        on_event: Callable[[str], None] | None = None,
        extra_checks: Iterable[Callable[[], None]] = (),
    ):
        self.server_pid = server_pid
        self.health_dir = Path(health_dir)
        self.metrics_path = metrics_path
        self._reload = reload
        self._loaded = loaded
        self._reaches = reaches
        self.interval = interval
        self.on_event = on_event or (lambda text: log.warning("%s", text))
        self.counters = Counters()
        self.extra_checks = list(extra_checks)  # run at each scan; one that raises ends the scan
        self.unhealthy: dict[str, str] = {}  # model -> reason (the dead model's name for callers)
        self._known: dict[int, Stub] = {}
        self._zombies: dict[int, Stub] = {}  # zombies of the last scan, not yet confirmed
        self._gone: list[Stub] = []  # stubs gone in the last scan, judged at this one
        self.watched: set[str] = set()  # every model whose stubs were seen: its series start at 0
        self._handled: set[int] = set()  # zombies already counted (they stay until the unload)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.events: list[tuple[float, str, str]] = []  # (time, kind, model)
        # Replaced models tritonserver will never finish unloading (one per reload): at shutdown
        # they are the "live models" it waits --exit-timeout-secs for.
        self.lingering = 0

    # -- the thread ------------------------------------------------------------------------------

    def start(self) -> StubWatchdog:
        self.health_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.health_dir.iterdir():
            stale.unlink(missing_ok=True)
        self._known = {s.pid: s for s in find_stubs(self.server_pid) if not s.zombie}
        self.watched = {s.model for s in self._known.values()}
        self._write_metrics()
        self._thread = threading.Thread(target=self._run, name="stub-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not process_running(self.server_pid):
                # tritonserver itself died (its stubs follow it): that is its launcher's to see and
                # restart, with a new watchdog; a scan now could only fail to reach its repository API.
                log.info("stub watchdog: tritonserver (pid %d) is gone; the watchdog stops", self.server_pid)
                return
            try:
                self.poll()
            except Exception:  # the watchdog must outlive any one bad scan
                log.exception("stub watchdog: scan failed")

    # -- one scan --------------------------------------------------------------------------------

    def dead_models(self) -> dict[str, list[Stub]]:
        """model -> its stubs that died, confirmed over two scans.

        A stub that died stays a zombie until tritonserver reaps it, which its python backend
        does when it next checks the stub's health (a request routed to it): so a death shows
        as a zombie or as a stub gone. A stub also goes when tritonserver ends it (an unload, a
        reload's swap to new instances): then, by the next scan, its model version is no longer
        READY, or a live stub of the same instance and version has taken over. What is left is a
        death."""
        now = find_stubs(self.server_pid)
        alive = {s.pid: s for s in now if not s.zombie}
        zombies = {s.pid: s for s in now if s.zombie and s.pid not in self._handled}
        gone = [s for pid, s in self._known.items() if pid not in alive and pid not in self._handled]
        # Candidates: zombies of the last scan still zombies, and stubs gone since the last scan
        # but one (a scan's grace for tritonserver's own unloads to show in the index).
        candidates = [s for pid, s in zombies.items() if pid in self._zombies]
        candidates += [s for s in self._gone if s.pid not in {c.pid for c in candidates}]
        self._zombies = zombies
        self._gone = [s for s in gone if s.pid not in zombies]
        self._known = alive
        models = {s.model for s in alive.values()}
        if not models <= self.watched:
            self.watched |= models
            self._write_metrics()
        if not candidates:
            return {}
        loaded = self._loaded()
        dead: dict[str, list[Stub]] = {}
        for stub in candidates:
            self._handled.add(stub.pid)
            replaced = any(s.instance == stub.instance and s.version == stub.version for s in alive.values())
            ready = (stub.model, stub.version) in loaded if stub.version else any(m == stub.model for m, _ in loaded)
            if ready and not replaced:
                dead.setdefault(stub.model, []).append(stub)
        return dead

    def poll(self) -> None:
        for check in self.extra_checks:
            check()
        for model, stubs in self.dead_models().items():
            names = ", ".join(s.instance or str(s.pid) for s in stubs)
            self.counters.deaths[model] = self.counters.deaths.get(model, 0) + len(stubs)
            self._event("death", model, f"stub watchdog: {model}: stub {names} died; marking it unhealthy and reloading")
            self._heal(model, names)

    def _heal(self, model: str, names: str) -> None:
        started = time.monotonic()
        before = [s for s in find_stubs(self.server_pid) if s.model == model and not s.zombie]
        reached = sorted(set(self._reaches(model)) | {model})
        for name in reached:
            reason = f"instance {names} of {model} died at {time.strftime('%H:%M:%S')}; reloading"
            self.unhealthy[name] = reason
            (self.health_dir / name).write_text(reason + "\n", encoding="utf-8")
        (self.health_dir / ANY_UNHEALTHY).write_text("\n".join(reached) + "\n", encoding="utf-8")
        self._write_metrics()
        try:
            self._reload(model)
        except Exception as exc:
            self.counters.reload_failures[model] = self.counters.reload_failures.get(model, 0) + 1
            self._write_metrics()
            self._event("reload_failed", model, f"stub watchdog: {model}: reload failed ({exc}); it stays unhealthy")
            return
        self.counters.reloads[model] = self.counters.reloads.get(model, 0) + 1
        reloaded_s = time.monotonic() - started
        # tritonserver 2.51 never finishes unloading the replaced model (a request of the dead
        # instance keeps it referenced): its surviving stubs would hold their memory until the
        # server exits. New requests go to the new instances; once those in flight on the old
        # ones are done, the old stubs are ended.
        self._stop.wait(REPLACED_GRACE_S)
        for stub in before:
            self._handled.add(stub.pid)  # its zombie is this watchdog's doing, not a death
            try:
                os.kill(stub.pid, 9)
            except OSError:
                pass
        self.lingering += 1
        self._known = {s.pid: s for s in find_stubs(self.server_pid) if not s.zombie}
        for name in reached:
            self.unhealthy.pop(name, None)
            (self.health_dir / name).unlink(missing_ok=True)
        if not self.unhealthy:
            (self.health_dir / ANY_UNHEALTHY).unlink(missing_ok=True)
        self.counters.last_recovery_s[model] = reloaded_s
        self._write_metrics()
        self._event(
            "recovered",
            model,
            f"stub watchdog: {model}: new instances serving {reloaded_s:.1f} s after "
            f"the death; the replaced stubs ended, healthy again",
        )

    def _event(self, kind: str, model: str, text: str) -> None:
        self.events.append((time.time(), kind, model))
        self.on_event(text)

    # -- metrics ---------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        c = self.counters
        lines = [
            "# HELP triton_stub_deaths_total Python backend stubs that died while their model was loaded.",
            "# TYPE triton_stub_deaths_total counter",
        ]
        lines += [f'triton_stub_deaths_total{{model="{m}"}} {c.deaths.get(m, 0)}' for m in sorted(self.watched | set(c.deaths))]
        lines += [
            "# HELP triton_stub_reloads_total Models the watchdog reloaded after a stub died.",
            "# TYPE triton_stub_reloads_total counter",
        ]
        lines += [
            f'triton_stub_reloads_total{{model="{m}"}} {c.reloads.get(m, 0)}' for m in sorted(self.watched | set(c.reloads))
        ]
        lines += [
            "# HELP triton_stub_reload_failures_total Reloads after a stub death that failed.",
            "# TYPE triton_stub_reload_failures_total counter",
        ]
        lines += [
            f'triton_stub_reload_failures_total{{model="{m}"}} {c.reload_failures.get(m, 0)}'
            for m in sorted(self.watched | set(c.reload_failures))
        ]
        lines += [
            "# HELP triton_model_unhealthy 1 while a model has a dead instance (or reaches one) and is being reloaded.",
            "# TYPE triton_model_unhealthy gauge",
        ]
        lines += [
            f'triton_model_unhealthy{{model="{m}"}} {1 if m in self.unhealthy else 0}'
            for m in sorted(self.watched | set(self.unhealthy))
        ]
        lines += [
            "# HELP triton_stub_watchdog_up 1 while the launcher's stub watchdog runs.",
            "# TYPE triton_stub_watchdog_up gauge",
            "triton_stub_watchdog_up 1",
        ]
        return "\n".join(lines) + "\n"

    def _write_metrics(self) -> None:
        if self.metrics_path is None:
            return
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text(self.metrics_text(), encoding="utf-8")
        os.replace(tmp, self.metrics_path)


RELOAD_PARAMETER = "watchdog_reload"


def repository_reload(repository_client) -> Callable[[str], None]:
    """A reload through Triton's repository API: the model's live configuration as an override,
    with the parameter ``watchdog_reload`` set to a new value. tritonserver reloads a model only
    when its configuration changed (a plain load, or an override equal to the live config, of an
    unchanged model does nothing); no model reads that parameter."""

    def reload(model: str) -> None:
        config = repository_client.config(model)
        parameters = config.setdefault("parameters", {})
        parameters[RELOAD_PARAMETER] = {"string_value": f"{time.time_ns()}"}
        repository_client.load(model, config)

    return reload


def repository_loaded(repository_client) -> Callable[[], set[tuple[str, str]]]:
    """The (model, version) pairs READY now, from the repository index."""
    from ops.repository import http

    def loaded() -> set[tuple[str, str]]:
        status, raw = http(repository_client.base + "/v2/repository/index", "POST", {}, repository_client.headers, timeout=10)
        if status != 200:
            raise RuntimeError(f"repository index: HTTP {status}")
        return {(entry["name"], str(entry.get("version", ""))) for entry in json.loads(raw) if entry.get("state") == "READY"}

    return loaded


def watch_server(
    server_pid: int,
    triton_http_url: str,
    token: str,
    repository: Path,
    health_dir: Path,
    metrics_path: Path | None,
    on_event: Callable[[str], None] | None = None,
) -> StubWatchdog:
    """A started watchdog over the tritonserver ``server_pid``: it reads and reloads models
    through the repository API at ``triton_http_url`` (``token``: the repository token), and a
    model's dead stub marks every loaded model that reaches it in ``repository``."""
    from ops.repository import RepositoryClient
    from server.models import closure

    client = RepositoryClient(triton_http_url, token=token)
    loaded = repository_loaded(client)

    def reaches(model: str) -> list[str]:
        return sorted({m for m, _ in loaded() if model in closure(repository, m)})

    return StubWatchdog(
        server_pid,
        health_dir,
        metrics_path,
        repository_reload(client),
        loaded,
        reaches,
        on_event=on_event,
    ).start()
