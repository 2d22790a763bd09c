"""Start, watch and stop one local tritonserver process, with its stub watchdog.

Every deployment's replicas are these (server/deployment.py: ``make serve``, serve-cluster, the
integration tests' fixture and the perf harness), so all run the server exactly the same way;
the doors in front of them are the deployment's (server/doors.py). The process itself is a
server.supervisor.ChildProcess; the repository is prepared before (server/repository_prep.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
import sys
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO, TypeVar

from contract.prose import triton_live_models
from ops.repository import TOKEN_HEADER
from server.layout import ROOT, ServerLayout, prepare
from server.models import DEFAULT_MODELS, closure, default_models, with_dependencies  # noqa: F401 (tests, perf/)
from server.repository_prep import Prepared
from server.repository_prep import prepare as prepare_repository
from server.stubs import StubWatchdog, watch_server
from server.supervisor import PIPE, ChildProcess, NotReady, Service, free_port, http_status

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """The server did not come up; ``log_tail`` holds the end of its log (at ``log_path``)."""

    def __init__(self, message: str, log_tail: str = "", log_path: Path | None = None):
        super().__init__(message)
        self.log_tail = log_tail
        self.log_path = log_path


# make serve's response cache (text_tokenizer and image_preprocess; docs/result-cache.md): a
# tokenized text takes a few hundred bytes, a preprocessed image 602 KB.
DEFAULT_CACHE_SIZE_MB = 128
_Options = TypeVar("_Options", bound="ServerOptions")  # not typing.Self: NVIDIA's container has Python 3.10


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
    # SIGTERM drain: seconds for tritonserver's own graceful shutdown (--exit-timeout-secs), and
    # for the deployment's front door before it, before each is killed.
    drain_timeout: float = 30.0
    # The stub watchdog's folder of unhealthy models (server/stubs.py). None: a temporary one,
    # removed at stop. A deployment passes one per replica, kept across its restarts, so that its
    # front door and gRPC door see which replica is healing a model.
    health_dir: Path | None = None
    # Its log is tritonserver-<log_name>.log in workdir, written over at each start; "": its HTTP port.
    log_name: str = ""
    # An installed tritonserver run in place (NVIDIA's container: /opt/tritonserver), checked by
    # server.layout.check_home where it enters; None: the nvidia-pytriton wheel's, laid out in workdir.
    tritonserver_home: Path | None = None

    def __post_init__(self):
        if not self.models:
            self.models = default_models(self.model_repository)

    @classmethod
    def with_free_ports(cls: type[_Options], **kwargs) -> _Options:
        host = kwargs.get("host", "127.0.0.1")
        ports: set[int] = set()
        while len(ports) < 3:
            ports.add(free_port(host))
        http, grpc, metrics = sorted(ports)
        return cls(http_port=http, grpc_port=grpc, metrics_port=metrics, **kwargs)

    @property
    def log_path(self) -> Path:
        return Path(self.workdir) / f"tritonserver-{self.log_name or self.http_port}.log"

    @property
    def reachable_host(self) -> str:
        """Where a client on this machine reaches ``host`` (every address: loopback)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        return f"{self.reachable_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.reachable_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.reachable_host}:{self.metrics_port}/metrics"


SHM_DIR = Path("/dev/shm")
_OWNED_REGION = re.compile(r"triton_p(\d+)_[0-9a-f]+_")


def release_orphaned_shared_memory() -> list[str]:
    """Unlink the regions in /dev/shm of TritonServers whose launcher process is gone (killed
    with SIGKILL, it could not release them; its tritonservers died with it); their names. A
    launcher's pid reused by another process keeps its regions until that one ends."""
    gone: list[str] = []
    if not SHM_DIR.is_dir():
        return gone
    for region in SHM_DIR.iterdir():
        match = _OWNED_REGION.match(region.name)
        if match is None or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            region.unlink()
            gone.append(region.name)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Addresses:
    """``http_url``, ``grpc_url`` and ``metrics_url`` of ``options``' host and ports: a
    TritonServer's own (behind a deployment's doors, internal ones), a Deployment's public ones."""

    options: ServerOptions

    @property
    def http_url(self) -> str:
        return self.options.http_url

    @property
    def grpc_url(self) -> str:
        return self.options.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.options.metrics_url


class TritonServer(Addresses, Service):
    """A tritonserver child process on the options' address and ports, with its stub watchdog
    once ready. Use as a context manager or call start()/wait_ready()/stop()."""

    def __init__(self, options: ServerOptions, echo: TextIO | None = None):
        self.options = options
        self.echo = echo
        self.repository: Prepared | None = None  # as prepared for the current start
        self.log_path = options.log_path
        # Ctrl-C reaches the launcher, which stops the server in order. If the launcher dies
        # without stopping it (SIGKILL, the OOM killer), so does tritonserver, and its ports are
        # free again; its python backend stubs notice and exit.
        self.child = ChildProcess("tritonserver", self.log_path, output=PIPE, log_mode="w", tie="SIGKILL", echo=echo)
        self.layout: ServerLayout | None = None
        self.watchdog: StubWatchdog | None = None
        # The python backend's shared memory regions in /dev/shm (the Python-based onnxruntime
        # backend's too: it takes the python backend's configuration) carry this server's own
        # prefix: a killed tritonserver never unlinks them, so they are removed after it stops
        # (or before it starts again), by this prefix alone. Containers drop /dev/shm with them.
        # The launcher's pid in the name: a launcher killed with SIGKILL cannot release its
        # servers' regions, and the next start of any server releases them (release_orphaned).
        self.shm_prefix = f"triton_p{os.getpid()}_{secrets.token_hex(4)}_"
        self._health_dir: Path | None = None

    @property
    def process(self):
        """tritonserver's subprocess.Popen (None before start)."""
        return self.child.process

    def command(self) -> list[str]:
        o = self.options
        assert self.layout is not None
        http_port, grpc_port, metrics_port, bind = o.http_port, o.grpc_port, o.metrics_port, o.host
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
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}python_",
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
        # The rollout state's models are loaded through the repository API once the server is up.
        deferred = set(self.repository.deferred if self.repository is not None else ())
        cmd += [f"--load-model={m}" for m in with_dependencies(o.model_repository, o.models) if m not in deferred]
        cmd += list(o.extra_args)
        return cmd

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

    def start(self, repository: Prepared | None = None) -> TritonServer:
        """Start tritonserver on ``repository``, as prepared for this start by
        server/repository_prep.py (a deployment does it before each start of a replica); None:
        prepared here."""
        o = self.options
        # A restart of this object: the last run's watchdog watched a process that is gone.
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        o.workdir.mkdir(parents=True, exist_ok=True)
        self.release_shared_memory()  # a killed last run of this object left its regions
        release_orphaned_shared_memory()  # and those of launchers that were killed
        self.layout = prepare(o.workdir, o.tritonserver_home)
        self.repository = repository or prepare_repository(o.model_repository, o.models, o.rollout_state)
        self.child.start(self.command(), env=self.environment())
        return self

    @property
    def watchdog_metrics_path(self) -> Path:
        """The watchdog's Prometheus text file (served by the front door at /metrics/watchdog)."""
        return self.health_dir / ".watchdog.prom"

    def start_watchdog(self) -> None:
        """Start the stub watchdog (server/stubs.py) once the server is ready; idempotent."""
        if self.watchdog is not None or not self.child.running():
            return

        def event(text: str) -> None:
            log.warning("%s", text)
            if self.echo is not None:
                self.echo.write(text + "\n")
                self.echo.flush()

        self.watchdog = watch_server(
            self.process.pid,
            self.http_url,
            self.options.repository_token or "",
            self.options.model_repository,
            self.health_dir,
            self.watchdog_metrics_path,
            on_event=event,
        )

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
            self._health_dir = Path(tempfile.mkdtemp(prefix=f"triton-health-{self.options.http_port}-"))
            self._health_dir.chmod(0o755)
        return self._health_dir

    def log_tail(self, lines: int = 60) -> str:
        return self.child.log_tail(lines)

    def _get(self, path: str, timeout: float = 2.0) -> int:
        return http_status(f"http://{self.http_url}{path}", timeout)

    def wait_ready(self, timeout: float = 240.0, should_stop=lambda: False) -> None:
        """Poll /v2/health/ready and each model's ready endpoint until all are ready (loading the
        rollout state's deferred models once the server is up), then start the stub watchdog.

        ``should_stop`` is polled too (Ctrl-C while waiting): it raises ServerError.
        """
        pending = list(self.options.models)
        deferred_loaded = self.repository is None or not self.repository.deferred

        def ready() -> bool:
            nonlocal pending, deferred_loaded
            if self._get("/v2/health/ready") != 200:
                return False
            if not deferred_loaded:
                assert self.repository is not None  # deferred_loaded starts True without a prepared repository
                try:
                    self.repository.load_deferred(
                        self.http_url, self.options.repository_token or "", self.options.model_config_name
                    )
                except Exception as exc:
                    raise ServerError(
                        f"applying the rollout state {self.options.rollout_state} failed: {exc}", self.log_tail()
                    ) from exc
                deferred_loaded = True
            pending = [m for m in pending if self._get(f"/v2/models/{m}/ready") != 200]
            return not pending

        try:
            self.child.wait_ready(ready, timeout, should_stop=should_stop, interval=0.25)
        except NotReady as exc:
            if exc.why == "stopped":
                raise ServerError("stopped before the server became ready", self.log_tail()) from None
            if exc.why == "exited":
                raise ServerError(
                    f"tritonserver exited with code {exc.returncode} before becoming ready", self.log_tail()
                ) from None
            raise ServerError(
                f"tritonserver not ready after {timeout:.0f} s (models not ready: {', '.join(pending) or 'none'})",
                self.log_tail(),
            ) from None
        self.start_watchdog()

    def stop(self, timeout: float | None = None) -> int | None:
        """Drain and stop: SIGTERM to tritonserver and its graceful shutdown, killed after
        ``timeout`` seconds (default: the options' drain_timeout)."""
        timeout = self.options.drain_timeout if timeout is None else timeout
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.process is None:
            return None
        # --exit-timeout-secs bounds Triton's own wait for in-flight requests. Stubs are children
        # of the server: its process group is killed after it, so that none outlives it.
        code = self.child.stop(
            timeout + 5, signal.SIGTERM, kill_group=True, reap_group=True, while_waiting=self._lingering_check()
        )
        if self._health_dir is not None:
            import shutil

            shutil.rmtree(self._health_dir, ignore_errors=True)
        self.release_shared_memory()
        return code

    def release_shared_memory(self) -> list[str]:
        """Unlink this server's shared memory regions left in /dev/shm (the stubs' and the
        server's, which a SIGKILL leaves behind: 15 GB after one day of tests); their names."""
        gone = []
        for region in SHM_DIR.glob(f"{self.shm_prefix}*"):
            with contextlib.suppress(OSError):
                region.unlink()
                gone.append(region.name)
        return gone

    def _lingering_check(self):
        """While tritonserver shuts down: once only the models the watchdog replaced after a stub
        death remain (tritonserver 2.51 never finishes unloading those; its shutdown log says
        "Found N live models and 0 in-flight"), it is killed instead of waiting out the exit
        timeout."""
        lingering = self.watchdog.lingering if self.watchdog is not None else 0
        if not lingering:
            return None

        def check() -> None:
            live = triton_live_models(self.child.tail())
            if live is not None and live <= lingering:
                log.warning("tritonserver: only the %s model(s) replaced after a stub death remain; stopping it", live)
                os.killpg(self.process.pid, signal.SIGKILL)

        return check
