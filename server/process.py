"""Start, watch and stop one local tritonserver process.

Used by ``make serve`` (``python -m server``) and by the integration tests' fixture, so
both run the server exactly the same way.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence, TextIO

from ops.repository import TOKEN_HEADER
from server.frontdoor import DEFAULT_MAX_BODY_BYTES, FrontDoor, FrontDoorPorts
from server.grpc_door import GrpcDoor
from server.stubs import StubWatchdog
from server.layout import ROOT, ServerLayout, prepare
from server.lifetime import tie_to_parent

log = logging.getLogger(__name__)

# text_embedding_cached: the cached entry point in front of text_embedding (README "Result cache").
# text_generation: the LLM (docs/export.md); its weights are exported by `python -m export`.
DEFAULT_MODELS = ("text_embedding", "text_embedding_cached", "text_embedding_cached_interactive",
                  "text_embedding_cached_bulk", "image_classification", "text_generation")
# Default models a repository may lack: left out of the default set when their folder has no
# config.pbtxt (a repository made before the generation model, or one holding only the
# embedding and image models). Asked for by name (--model), they load or fail as any other.
OPTIONAL_DEFAULT_MODELS = ("text_generation",)


def default_models(repository: Path) -> tuple[str, ...]:
    """The models `python -m server` loads when none are named."""
    return tuple(m for m in DEFAULT_MODELS
                 if m not in OPTIONAL_DEFAULT_MODELS or (Path(repository) / m / "config.pbtxt").is_file())


def _config_text(repository: Path, model: str) -> str:
    path = Path(repository) / model / "config.pbtxt"
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def references(repository: Path, model: str) -> tuple[list[str], list[str]]:
    """(ensemble steps, ``load_with`` targets) named in a model's config.pbtxt."""
    text = _config_text(repository, model)
    steps = re.findall(r'model_name:\s*"([^"]+)"', text)
    m = re.search(r'key:\s*"load_with"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    return steps, [t.strip() for t in (m.group(1).split(",") if m else []) if t.strip()]


def closure(repository: Path, model: str) -> list[str]:
    """Every model a request to ``model`` may reach through ensemble steps and ``load_with``."""
    out: list[str] = []
    todo = [model]
    while todo:
        current = todo.pop()
        if current in out:
            continue
        out.append(current)
        steps, targets = references(repository, current)
        todo += steps + targets
    return out


def with_dependencies(repository: Path, models: Sequence[str]) -> list[str]:
    """``models`` plus what Triton does not load for them: the ``load_with`` targets of a BLS
    model (text_encoder_router names text_encoder), also when it is an ensemble's step. The
    targets come first."""
    out: list[str] = []
    for model in models:
        for reached in closure(repository, model):
            for target in references(repository, reached)[1]:
                if target not in out:
                    out.append(target)
    return out + [m for m in models if m not in out]


def http_status(url: str, timeout: float = 2.0) -> int:
    """The HTTP status of a GET of ``url``; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


class ServerError(RuntimeError):
    """The server did not come up; ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerOptions:
    model_repository: Path = ROOT / "model_repository"
    workdir: Path = ROOT / ".triton"
    models: Sequence[str] = ()  # empty: default_models(model_repository)
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    cache_size_bytes: int = 0  # Triton's local response cache; 0 = off
    model_config_name: str | None = None  # --model-config-name: a precision variant (export/variants.py)
    log_verbose: int = 0
    # Triton's latency summaries (quantiles over a sliding window) for the P99 alerts: on where a
    # Prometheus reads them (serve-cluster, compose, Kubernetes, `--summary-latencies`); off by
    # default, since they cost the tail at high request rates (docs/monitoring.md).
    summary_latencies: bool = False
    extra_args: Sequence[str] = field(default_factory=tuple)
    # Added to the server's environment, which the python backend stubs inherit: e.g.
    # EMBEDDING_CACHE_L2_REDIS_URL for text_embedding_cached (python_backends/cache/settings.py).
    env: Mapping[str, str] = field(default_factory=dict)
    # Protects the repository API (load/unload) with the header ``triton-repository-token``
    # (ops/repository.py); None leaves it open. The launcher always sets one.
    repository_token: str | None = None
    # A rollout state file (ops/rollout.py): when it exists, the encoder and its router are
    # loaded with the versions and weights it records before the models that use them.
    rollout_state: Path | None = None
    # The front door (server/frontdoor.py): nginx on http/grpc/metrics_port checks HTTP
    # inference requests; tritonserver then listens on 127.0.0.1 at the triton_* ports (0 = a
    # free port chosen at start). Off: tritonserver itself on the public ports, undefended.
    front_door: bool = True
    triton_http_port: int = 0
    triton_grpc_port: int = 0
    triton_metrics_port: int = 0
    # nginx's own gRPC listener on 127.0.0.1 (0 = a free port chosen at start). The gRPC door
    # (server/grpc_door.py) holds grpc_port, checks every inference request and forwards it to
    # tritonserver directly (one hop less: 0.78 -> 0.84 of direct throughput, docs/security.md).
    nginx_grpc_port: int = 0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # SIGTERM drain: seconds the front door finishes in-flight requests, then tritonserver's
    # own graceful shutdown (--exit-timeout-secs), before each is killed.
    drain_timeout: float = 30.0
    # The stub watchdog's folder of unhealthy models (server/stubs.py). None: a temporary one,
    # removed at stop. serve-cluster passes one per replica, kept across its restarts, so that
    # its front door and gRPC door see which replica is healing a model.
    health_dir: Path | None = None

    def __post_init__(self):
        if not self.models:
            self.models = default_models(self.model_repository)

    @classmethod
    def with_free_ports(cls, **kwargs) -> "ServerOptions":
        host = kwargs.get("host", "127.0.0.1")
        ports = set()
        while len(ports) < 3:
            ports.add(free_port(host))
        http, grpc, metrics = sorted(ports)
        return cls(http_port=http, grpc_port=grpc, metrics_port=metrics, **kwargs)

    def internal_ports(self) -> tuple[int, int, int]:
        """tritonserver's own (http, grpc, metrics) ports: the public ones without a front door."""
        if not self.front_door:
            return self.http_port, self.grpc_port, self.metrics_port
        return self.triton_http_port, self.triton_grpc_port, self.triton_metrics_port


class TritonServer:
    """A tritonserver child process. Use as a context manager or call start()/stop()."""

    def __init__(self, options: ServerOptions, echo: TextIO | None = None):
        self.options = options
        self.echo = echo
        self.process: subprocess.Popen | None = None
        self.log_path = options.workdir / f"tritonserver-{options.http_port}.log"
        self._tail: collections.deque[str] = collections.deque(maxlen=400)
        self._reader: threading.Thread | None = None
        self.layout: ServerLayout | None = None
        self.front_door: FrontDoor | None = None
        self.grpc_door: GrpcDoor | None = None
        self.watchdog: StubWatchdog | None = None
        self._health_dir: Path | None = None

    @property
    def _public_host(self) -> str:
        return "127.0.0.1" if self.options.host in ("0.0.0.0", "") else self.options.host

    @property
    def http_url(self) -> str:
        """Where clients go: the front door's HTTP port (tritonserver's own without one)."""
        return f"{self._public_host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._public_host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._public_host}:{self.options.metrics_port}/metrics"

    @property
    def triton_host(self) -> str:
        return "127.0.0.1" if self.options.front_door else self._public_host

    @property
    def triton_http_url(self) -> str:
        """tritonserver's own HTTP port (internal behind the front door)."""
        return f"{self.triton_host}:{self.options.internal_ports()[0]}"

    @property
    def triton_grpc_url(self) -> str:
        return f"{self.triton_host}:{self.options.internal_ports()[1]}"

    def command(self) -> list[str]:
        o = self.options
        assert self.layout is not None
        http_port, grpc_port, metrics_port = o.internal_ports()
        bind = "127.0.0.1" if o.front_door else o.host
        cmd = [
            str(self.layout.binary),
            f"--model-repository={o.model_repository.resolve()}",
            f"--backend-directory={self.layout.backends}",
            f"--cache-directory={self.layout.caches}",
            "--model-control-mode=explicit",
            f"--http-address={bind}",
            f"--http-port={http_port}",
            f"--grpc-address={bind}",
            f"--grpc-port={grpc_port}",
            f"--metrics-address={bind}",
            f"--metrics-port={metrics_port}",
            "--allow-metrics=true",
            "--exit-on-error=true",
            "--strict-readiness=true",
            f"--exit-timeout-secs={max(1, int(o.drain_timeout))}",
            f"--log-verbose={o.log_verbose}",
            # The python backend's shared memory grows in these steps; a batch of 64 images x
            # 3 x 224 x 224 floats is 38 MB between image preprocessing and the classifier.
            "--backend-config=python,shm-default-byte-size=16777216",
            "--backend-config=python,shm-growth-byte-size=16777216",
        ]
        if o.summary_latencies:
            # Queue and request time quantiles (nv_inference_*_summary_us{quantile}) for the P99
            # alerts of deploy/prometheus/rules (docs/monitoring.md): the counters only give means.
            cmd.append("--metrics-config=summary_latencies=true")
        if o.model_config_name:
            cmd.append(f"--model-config-name={o.model_config_name}")
        if o.cache_size_bytes > 0:
            cmd.append(f"--cache-config=local,size={o.cache_size_bytes}")
        if o.repository_token:
            # Load/unload need the header; inference, health, metadata and statistics stay open.
            cmd.append(f"--http-restricted-api=model-repository:{TOKEN_HEADER}={o.repository_token}")
            cmd.append(f"--grpc-restricted-protocol=model-repository:{TOKEN_HEADER}={o.repository_token}")
            # Registering shared memory, changing trace or log settings: operator actions too.
            cmd.append(f"--http-restricted-api=shared-memory,trace,logging:{TOKEN_HEADER}={o.repository_token}")
            cmd.append(f"--grpc-restricted-protocol=shared-memory,trace,logging:{TOKEN_HEADER}={o.repository_token}")
        deferred = set(self.deferred_models())
        cmd += [f"--load-model={m}" for m in with_dependencies(o.model_repository, o.models) if m not in deferred]
        cmd += list(o.extra_args)
        return cmd

    def rollout_plan(self):
        """The rollout state's load plan (ops.rollout.LoadPlan), or None without a state file."""
        path = self.options.rollout_state
        if path is None or not Path(path).is_file():
            return None
        from ops.rollout import load_plan

        return load_plan(Path(path))

    def deferred_models(self) -> list[str]:
        """Models loaded through the repository API after start, in order: the rollout state's
        encoder (its versions), the router (its weights) when the state puts it in front of
        text_embedding or a requested model reaches it, then the requested models that reach
        either (text_embedding in the form the state calls for)."""
        plan = self.rollout_plan()
        if plan is None:
            return []
        repo = self.options.model_repository
        wanted = with_dependencies(repo, self.options.models)
        reached = {m for model in wanted for m in closure(repo, model)}
        first = [plan.encoder] + ([plan.router] if plan.routed or plan.router in reached else [])
        out = list(first)
        for model in wanted:
            if model not in first and set(first) & set(closure(repo, model)):
                out.append(model)
        return out

    def apply_rollout_state(self) -> None:
        """Load the deferred models with the state's overrides, in deferred_models' order (each
        load returns when that model is ready)."""
        plan = self.rollout_plan()
        if plan is None:
            return
        from ops.repository import RepositoryClient

        client = RepositoryClient(self.triton_http_url, token=self.options.repository_token or "")
        for model in self.deferred_models():
            client.load(model, plan.override(model, self.options.model_repository, self.options.model_config_name))

    def environment(self) -> dict[str, str]:
        assert self.layout is not None
        env = dict(os.environ)
        # The stub links libpython3.X.so.1.0; without this it takes the system's (Debian 12:
        # 3.11.2) while importing the virtualenv interpreter's standard library (e.g. pyenv's
        # 3.11.7), whose C extensions may need newer symbols (_ssl did: redis-py then failed).
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        ldlibrary = sysconfig.get_config_var("INSTSONAME") or ""
        own_libpython = libdir if ldlibrary and (Path(libdir) / ldlibrary).is_file() else ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(self.layout.libs), own_libpython, env.get("LD_LIBRARY_PATH")) if p
        )
        # The python backend stub imports from the interpreter found first on PATH: ours.
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env.setdefault("HF_HUB_OFFLINE", "1")
        # Python models are not told --model-config-name; the result cache keys on the variant
        # it selects (python_backends/cache/identity.py).
        env["TRITON_MODEL_CONFIG_NAME"] = self.options.model_config_name or ""
        env.update(self.options.env)
        return env

    def start(self) -> "TritonServer":
        o = self.options
        # A restart of this object (a test's kill and start): the last run's watchdog watched a
        # process that is gone, and its door must not hold the port.
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.grpc_door is not None:
            self.grpc_door.stop(timeout=1)
            self.grpc_door = None
        o.workdir.mkdir(parents=True, exist_ok=True)
        self.layout = prepare(o.workdir)
        # Priority-class lanes follow their model's current config and versions (export/lanes.py);
        # while a rollout runs they serve its most-weighted version, not the canary.
        from export.lanes import render_all

        plan = self.rollout_plan()
        pins = {plan.encoder: max(plan.weights, key=plan.weights.get)} if plan is not None and plan.weights else None
        render_all(o.model_repository, pins)
        if o.front_door:
            taken = {o.http_port, o.grpc_port, o.metrics_port}
            for attr in ("triton_http_port", "triton_grpc_port", "triton_metrics_port", "nginx_grpc_port"):
                while not getattr(o, attr):
                    port = free_port("127.0.0.1")
                    if port not in taken:
                        setattr(o, attr, port)
                        taken.add(port)
            self.front_door = FrontDoor(
                FrontDoorPorts(o.host, o.http_port, o.nginx_grpc_port, o.metrics_port,
                               "127.0.0.1", o.triton_http_port, o.triton_grpc_port, o.triton_metrics_port,
                               grpc_listen_host="127.0.0.1"),
                o.workdir / f"frontdoor-{o.http_port}", o.model_repository, max_body_bytes=o.max_body_bytes,
                health_dir=self.health_dir,
            )
            self.front_door.check()
            self.grpc_door = GrpcDoor(f"{o.host}:{o.grpc_port}", f"127.0.0.1:{o.triton_grpc_port}", o.model_repository,
                                      self.front_door.workdir, self.health_dir, o.max_body_bytes, o.drain_timeout)
        log_file = self.log_path.open("w", encoding="utf-8")
        self.process = subprocess.Popen(
            self.command(),
            env=self.environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,  # Ctrl-C reaches us; we stop the server in order
            # If we die without stopping it (SIGKILL, the OOM killer), so does tritonserver,
            # and its ports are free again. Its python backend stubs notice and exit.
            preexec_fn=tie_to_parent("SIGKILL"),
        )
        self._reader = threading.Thread(target=self._pump, args=(self.process, log_file), daemon=True)
        self._reader.start()
        if self.front_door is not None:
            self.front_door.start()
        if self.grpc_door is not None:
            self.grpc_door.start()
        return self

    @property
    def watchdog_metrics_path(self) -> Path:
        """The watchdog's Prometheus text file (served by the front door at /metrics/watchdog)."""
        return self.health_dir / ".watchdog.prom"

    def start_watchdog(self) -> None:
        """Start the stub watchdog (server/stubs.py) once the server is ready; idempotent."""
        if self.watchdog is not None or self.process is None or self.process.poll() is not None:
            return
        from ops.repository import RepositoryClient
        from server.stubs import repository_loaded, repository_reload

        client = RepositoryClient(self.triton_http_url, token=self.options.repository_token or "")
        loaded = repository_loaded(client)
        repo = self.options.model_repository

        def reaches(model: str) -> list[str]:
            return sorted({m for m, _ in loaded() if model in closure(repo, m)})

        def event(text: str) -> None:
            log.warning("%s", text)
            if self.echo is not None:
                self.echo.write(text + "\n")
                self.echo.flush()

        def door_alive() -> None:
            # The gRPC door holds no state: if it exits, a new one takes the port at once.
            door = self.grpc_door
            if door is not None and door.process is not None and door.process.poll() is not None:
                event(f"gRPC door: exited (code {door.process.returncode}); starting a new one\n{door.log_tail(10)}")
                door.start()

        self.watchdog = StubWatchdog(self.process.pid, self.health_dir, self.watchdog_metrics_path,
                                     repository_reload(client), loaded, reaches, on_event=event,
                                     extra_checks=[door_alive]).start()

    @property
    def health_dir(self) -> Path:
        """The watchdog's folder of unhealthy models, read by the front doors' readiness answers.
        nginx's workers run as another user (nobody) when the launcher is root, and the work
        folder may not be theirs to enter (a test's mkdtemp is 0700): the folder is made in the
        system's temporary folder, mode 0755, and removed at stop. It holds model names only."""
        if self.options.health_dir is not None:
            self.options.health_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            return self.options.health_dir
        if self._health_dir is None:
            import tempfile

            self._health_dir = Path(tempfile.mkdtemp(prefix=f"triton-health-{self.options.http_port}-"))
            self._health_dir.chmod(0o755)
        return self._health_dir

    def _pump(self, process: subprocess.Popen, log_file) -> None:
        with log_file:
            assert process.stdout is not None
            for line in process.stdout:
                log_file.write(line)
                log_file.flush()
                self._tail.append(line)
                if self.echo is not None:
                    self.echo.write(line)
                    self.echo.flush()

    def log_tail(self, lines: int = 60) -> str:
        return "".join(list(self._tail)[-lines:])

    def _get(self, path: str, timeout: float = 2.0, base: str | None = None) -> int:
        return http_status(f"http://{base or self.triton_http_url}{path}", timeout)

    def wait_ready(self, timeout: float = 240.0, should_stop=lambda: False) -> None:
        """Poll /v2/health/ready and each model's ready endpoint until all are ready.

        ``should_stop`` is polled too (Ctrl-C while waiting): it raises ServerError.
        """
        deadline = time.monotonic() + timeout
        pending = list(self.options.models)
        deferred_loaded = not self.deferred_models()
        while time.monotonic() < deadline:
            if should_stop():
                raise ServerError("stopped before the server became ready", self.log_tail())
            if self.process is None or self.process.poll() is not None:
                self._join_reader()
                code = None if self.process is None else self.process.returncode
                raise ServerError(f"tritonserver exited with code {code} before becoming ready", self.log_tail())
            if self.front_door is not None and not self.front_door.running():
                raise ServerError(f"the front door (nginx) exited with code {self.front_door.process.returncode}",
                                  self.front_door.log_tail())
            if self.grpc_door is not None and not self.grpc_door.running():
                raise ServerError(f"the gRPC door exited with code {self.grpc_door.process.returncode}",
                                  self.grpc_door.log_tail())
            if self._get("/v2/health/ready") == 200:
                if not deferred_loaded:
                    try:
                        self.apply_rollout_state()
                    except Exception as exc:
                        raise ServerError(f"applying the rollout state {self.options.rollout_state} failed: {exc}",
                                          self.log_tail()) from exc
                    deferred_loaded = True
                pending = [m for m in pending if self._get(f"/v2/models/{m}/ready") != 200]
                if not pending and (self.front_door is None or self._get("/v2/health/ready", base=self.http_url) == 200) \
                        and (self.grpc_door is None or self.grpc_door.ready()):
                    self.start_watchdog()
                    return
            time.sleep(0.25)
        raise ServerError(
            f"tritonserver not ready after {timeout:.0f} s (models not ready: {', '.join(pending) or 'none'})",
            self.log_tail(),
        )

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)

    def stop(self, timeout: float | None = None) -> int | None:
        """Drain and stop: the front door first (in-flight requests finish, new ones are
        refused), then SIGTERM to tritonserver and its graceful shutdown; each is killed
        after ``timeout`` seconds (default: the options' drain_timeout)."""
        timeout = self.options.drain_timeout if timeout is None else timeout
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.grpc_door is not None:
            self.grpc_door.stop(timeout=timeout)
        if self.front_door is not None:
            self.front_door.stop(timeout=timeout)
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                # --exit-timeout-secs bounds Triton's own wait for in-flight requests.
                self._wait_exit(timeout + 5)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop in %.0f s; killing it", timeout)
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Stubs are children of the server; make sure none outlives it.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._join_reader()
        if self._health_dir is not None:
            import shutil

            shutil.rmtree(self._health_dir, ignore_errors=True)
        return self.process.returncode

    def _wait_exit(self, timeout: float) -> None:
        """Wait for tritonserver to exit. Once only the models the watchdog replaced after a stub
        death remain (tritonserver 2.51 never finishes unloading those; its shutdown log says
        "Found N live models and 0 in-flight"), it is killed instead of waiting out the exit
        timeout."""
        lingering = self.watchdog.lingering if self.watchdog is not None else 0
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.process.args, timeout)
            if lingering:
                last = next((line for line in reversed(self._tail) if "live models and" in line), "")
                found = re.search(r"Found (\d+) live models and 0 in-flight", last)
                if found and int(found.group(1)) <= lingering:
                    log.warning("tritonserver: only the %s model(s) replaced after a stub death remain; stopping it",
                                found.group(1))
                    os.killpg(self.process.pid, signal.SIGKILL)
            time.sleep(0.1)

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
