"""The front door: nginx on the public ports, checking HTTP inference requests before tritonserver.

tritonserver 2.51 can be aborted by one HTTP request (its JSON parser allocates for the
declared shape before any check) and truncates the declared batch to 32 bits. nginx with the
njs check in ``deploy/frontdoor/infer_check.js`` refuses such requests with 400; gRPC goes
through ``grpc_pass`` unchanged (the models check declared batches); metrics answer GET only.
See docs/security.md.

The launcher starts it itself (``FrontDoor``). For docker-compose the same configuration is
rendered on the host into a folder the ``frontdoor`` service mounts::

    python -m server.frontdoor render --out .frontdoor   # make compose-config
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import signal
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from contract.errors import HTTP_STATUS, MARK
from contract.kserve import CONFIG_DATATYPES, DATATYPE_SIZES, MAX_RANK
from server.layout import ROOT
from server.supervisor import DISCARD, ChildProcess

log = logging.getLogger(__name__)

TEMPLATE_DIR = ROOT / "deploy" / "frontdoor"
JS_MODULE_CANDIDATES = (
    Path("/usr/lib/nginx/modules/ngx_http_js_module.so"),
    Path("/usr/lib64/nginx/modules/ngx_http_js_module.so"),
    Path("/usr/local/nginx/modules/ngx_http_js_module.so"),
)
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024

# docker-compose's front door (the official nginx image, which ships njs): where the rendered
# folder is mounted, the image's njs module, a writable folder of the image for temporary files
# and the pid, and the network aliases of the two Triton replicas.
COMPOSE_MOUNT = "/etc/nginx/frontdoor"
IMAGE_JS_MODULE = "/etc/nginx/modules/ngx_http_js_module.so"
COMPOSE_WORKDIR = "/var/cache/nginx"
COMPOSE_UPSTREAMS = ("triton-upstream-1", "triton-upstream-2")


class FrontDoorError(RuntimeError):
    pass


def nginx_binary() -> str:
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).is_file()), None)
    if not found:
        raise FrontDoorError("nginx is not installed (scripts/setup.sh installs nginx and libnginx-mod-http-js)")
    return found


def js_module() -> Path:
    for path in JS_MODULE_CANDIDATES:
        if path.is_file():
            return path
    raise FrontDoorError("nginx's njs module (ngx_http_js_module.so, Debian libnginx-mod-http-js) is not installed")


def _parse_config(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())


def model_limits(repository: Path) -> dict[str, dict]:
    """model -> {max_batch_size, decoupled, inputs: {name: {datatype, dims, max_elements}}} from every model's
    config.pbtxt and its variant configs (configs/*.pbtxt; the largest limit wins, since the
    launcher may select any of them). max_elements is 0 where a dimension is variable."""
    models: dict[str, dict] = {}
    for config in sorted(Path(repository).glob("*/config.pbtxt")):
        folder = config.parent
        paths = [config, *sorted((folder / "configs").glob("*.pbtxt"))]
        entry: dict | None = None
        for path in paths:
            try:
                parsed = _parse_config(path)
            except Exception as exc:  # a broken config fails its own load in Triton, loudly
                log.warning("front door: %s not parsed (%s); its model gets the global bound only", path, exc)
                continue
            mbs = int(parsed.max_batch_size)
            inputs = {}
            for t in parsed.input:
                dims = [int(d) for d in t.dims]
                count = 1
                for d in dims:
                    count *= d
                fixed = all(d >= 0 for d in dims)
                inputs[t.name] = {
                    "datatype": CONFIG_DATATYPES.get(model_config_datatype(t.data_type), ""),
                    "dims": dims,
                    "max_elements": (max(mbs, 1) * count) if fixed else 0,
                }
            decoupled = bool(parsed.model_transaction_policy.decoupled)
            if entry is None:
                entry = {"max_batch_size": mbs, "inputs": inputs, "decoupled": decoupled}
                continue
            entry["max_batch_size"] = max(entry["max_batch_size"], mbs)
            entry["decoupled"] = entry["decoupled"] or decoupled
            for name, spec in inputs.items():
                old = entry["inputs"].get(name)
                if old is not None:
                    bound = (
                        0 if 0 in (old["max_elements"], spec["max_elements"]) else max(old["max_elements"], spec["max_elements"])
                    )
                    spec = {**spec, "max_elements": bound}
                entry["inputs"][name] = spec
        if entry is not None:
            name = _config_name(config) or folder.name
            models[name] = entry
    return models


def model_config_datatype(value: int) -> str:
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2.DataType.Name(value)


def _config_name(path: Path) -> str:
    try:
        return _parse_config(path).name
    except Exception:
        return ""


def class_limits(repository: Path) -> dict[str, tuple[str, int]]:
    """entry model -> (priority class, admission_rows) for every model whose config.pbtxt names
    both (the class entries, docs/priority-classes.md). The front door keeps at most that many
    of the entry's HTTP requests in flight and answers the rest 503 itself, before tritonserver
    parses them: under a flood the refusals cost nginx microseconds instead of tritonserver's
    and the entry stubs' CPU, which the other classes' lanes need."""
    found: dict[str, tuple[str, int]] = {}
    for config in sorted(Path(repository).glob("*/config.pbtxt")):
        try:
            parsed = _parse_config(config)
        except Exception:
            continue
        params = {k: v.string_value for k, v in parsed.parameters.items()}
        cls, rows = params.get("priority_class"), params.get("admission_rows", "")
        if cls and rows.isdigit() and int(rows) > 0:
            if not re.fullmatch(r"[a-z][a-z0-9_]*", cls) or not re.fullmatch(
                r"[A-Za-z0-9_.-]+", parsed.name or config.parent.name
            ):
                raise FrontDoorError(f"{config}: priority_class {cls!r} or the model name cannot name an nginx zone")
            found[parsed.name or config.parent.name] = (cls, int(rows))
    return found


def class_limit_zones(limits: Mapping[str, tuple[str, int]]) -> str:
    """The http-level maps and limit_conn zones: one zone per entry model, keyed by the URI."""
    lines = []
    for i, model in enumerate(sorted(limits)):
        var = f"inflight_{i}"  # short: nginx's variables hash has 64-byte buckets
        lines += [
            f"# {model}: {limits[model][1]} requests in flight ({limits[model][0]} class)",
            f"map $uri ${var} {{",
            f"    ~^/v2/models/{re.escape(model)}(/versions/[0-9]+)?/infer$ 1;",
            '    default "";',
            "}",
            f"limit_conn_zone ${var} zone={var}:1m;",
        ]
    lines += ["map $uri $frontdoor_class {"]
    lines += [f"    ~^/v2/models/{re.escape(m)}(/versions/[0-9]+)?/infer$ {c};" for m, (c, _) in sorted(limits.items())]
    lines += ['    default "";', "}"]
    return "\n    ".join(lines)


def class_limit_conn(limits: Mapping[str, tuple[str, int]]) -> str:
    """The infer location's limit_conn lines (a request matches one entry's zone at most)."""
    lines = [f"limit_conn inflight_{i} {rows};  # {m}" for i, (m, (_, rows)) in enumerate(sorted(limits.items()))]
    return "\n            ".join(lines) if lines else "# no class entries in this repository"


def limits_module(
    repository: Path, max_body_bytes: int, health_dir: Path | str | None = None, healing_dirs: Sequence[Path | str] = ()
) -> str:
    """The generated ``limits.js`` that infer_check.js imports; ``health_dir``: the stub
    watchdog's folder of unhealthy models (server/stubs.py), as nginx sees it; ``healing_dirs``:
    more such folders (serve-cluster: one per replica), read only to decide whether a 500 is a
    dead stub being reloaded (then resent), never for readiness."""
    limits = {
        "health_dir": str(health_dir) if health_dir else "",
        "healing_dirs": [str(d) for d in healing_dirs],
        "max_body_bytes": max_body_bytes,
        # Each JSON element takes at least 2 bytes and each binary one at least 1: a request
        # whose data matches its shape cannot declare more elements than this.
        "max_elements": max_body_bytes,
        "max_rank": MAX_RANK,
        "models": model_limits(repository),
        # the contract (contract/): the datatypes' sizes, the mark after which a model's error
        # data follows tritonserver's words (moved into the body's keys here), each code's HTTP status
        "datatype_sizes": DATATYPE_SIZES,
        "error_mark": MARK,
        "error_status": HTTP_STATUS,
    }
    return (
        "// Generated by server/frontdoor.py from the model repository; do not edit.\nexport default "
        + json.dumps(limits, indent=1, sort_keys=True)
        + ";\n"
    )


@dataclass(frozen=True)
class Upstream:
    """One tritonserver behind the front door; ``down``: listed but sent nothing (not ready)."""

    host: str
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    down: bool = False

    @classmethod
    def parse(cls, text: str) -> Upstream:
        """``HOST`` (ports 8000, 8001, 8002) or ``HOST:HTTP:GRPC:METRICS``."""
        host, *ports = text.split(":")
        if not host or len(ports) not in (0, 3) or not all(p.isdigit() for p in ports):
            raise ValueError(f"upstream {text!r}: want HOST or HOST:HTTP:GRPC:METRICS")
        if not ports:
            return cls(host)
        http, grpc, metrics = map(int, ports)
        return cls(host, http, grpc, metrics)


@dataclass(frozen=True)
class GatewayServer:
    """One OpenAI gateway behind the front door; ``down``: listed but sent nothing (not ready)."""

    host: str
    port: int
    down: bool = False


# The gateway's own default request body limit (openai_gateway/settings.py, --max-body-mb 16).
DEFAULT_GATEWAY_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class GatewayDoor:
    """The front door's OpenAI port: nginx listens on ``port`` and proxies to ``servers``."""

    port: int
    servers: tuple[GatewayServer, ...]
    max_body_bytes: int = DEFAULT_GATEWAY_MAX_BODY_BYTES


# Passive health checks of every upstream server: after MAX_FAILS failed attempts within
# FAIL_TIMEOUT a replica gets no request for FAIL_TIMEOUT, then one request tries it again.
# nginx ignores both when an upstream has a single server (the one-server launcher).
MAX_FAILS = 2
FAIL_TIMEOUT_S = 5


@dataclass
class FrontDoorPorts:
    listen_host: str
    http: int
    grpc: int
    metrics: int
    upstream_host: str
    triton_http: int
    triton_grpc: int
    triton_metrics: int
    # Several tritonservers (serve-cluster, docker-compose's replicas); empty: the one above.
    replicas: tuple[Upstream, ...] = ()
    # serve-cluster's OpenAI gateways behind the front door; None: no gateway server block.
    gateway: GatewayDoor | None = None
    # Where nginx's gRPC listener binds when the gRPC door (server/grpc_door.py) holds the public
    # port and forwards to it: "127.0.0.1"; None: listen_host (no door, e.g. docker-compose).
    grpc_listen_host: str | None = None
    # serve-cluster's repository door (server/repository_door.py) on loopback; None: the
    # repository API goes to the one tritonserver.
    repository_door_port: int | None = None
    # docker-compose's repository door service (HOST:PORT on the compose network): the repository
    # API acts on every replica through it; /v2/cluster/ stays tritonserver's, since the replicas'
    # own addresses are not reachable from where ops.rollout runs (the host).
    repository_door_address: str | None = None
    # The gRPC door's HTTP stream listener (server/stream_door.py), HOST:PORT, where nginx sends
    # generate_stream; None: straight to tritonserver. stream_upstream_listen: where nginx's
    # internal listener for the stream door's own calls binds (replicas to balance); None: none.
    stream_door: str | None = None
    stream_upstream_listen: str | None = None

    @classmethod
    def cluster(
        cls,
        listen_host: str,
        http: int,
        grpc: int,
        metrics: int,
        replicas: Iterable[Upstream],
        gateway: GatewayDoor | None = None,
    ) -> FrontDoorPorts:
        replicas = tuple(replicas)
        if not replicas:
            raise FrontDoorError("a front door needs at least one upstream server")
        if gateway is not None and not gateway.servers:
            raise FrontDoorError("a gateway port needs at least one gateway server")
        first = replicas[0]
        return cls(listen_host, http, grpc, metrics, first.host, first.http, first.grpc, first.metrics, replicas, gateway)

    def upstreams(self) -> tuple[Upstream, ...]:
        return self.replicas or (Upstream(self.upstream_host, self.triton_http, self.triton_grpc, self.triton_metrics),)


def upstream_servers(servers: Sequence[Upstream], port: str, *, backup: bool = False) -> str:
    """The ``server`` lines of one upstream block (``port``: http, grpc or metrics). With
    ``backup`` every server after the first is a backup (the metrics port: one replica's
    counters at a time, the next one's when it fails)."""
    lines = []
    for i, s in enumerate(servers):
        # A lone server: as it always was (nginx ignores the passive checks for it).
        flags = [f"max_fails={MAX_FAILS}", f"fail_timeout={FAIL_TIMEOUT_S}s"] if len(servers) > 1 else []
        if backup and i > 0:
            flags.append("backup")
        if s.down:
            flags.append("down")
        lines.append(f"server {s.host}:{getattr(s, port)}{''.join(' ' + f for f in flags)};")
    return "\n        ".join(lines)


GATEWAY_BLOCK = re.compile(r"\n[ \t]*# BEGIN openai_gateway.*?# END openai_gateway[^\n]*\n", re.S)
STREAM_DOOR_BLOCK = re.compile(r"\n[ \t]*# BEGIN stream_door.*?# END stream_door[^\n]*\n", re.S)


def gateway_servers(servers: Sequence[GatewayServer]) -> str:
    """The ``server`` lines of the ``openai_gateway`` upstream (the passive checks as for Triton's)."""
    lines = []
    for s in servers:
        flags = [f"max_fails={MAX_FAILS}", f"fail_timeout={FAIL_TIMEOUT_S}s"] if len(servers) > 1 else []
        if s.down:
            flags.append("down")
        lines.append(f"server {s.host}:{s.port}{''.join(' ' + f for f in flags)};")
    return "\n        ".join(lines)


def render(
    ports: FrontDoorPorts,
    workdir: Path | str,
    js_path: Path,
    max_body_bytes: int,
    workers: int | str = 1,
    js_module_path: Path | str | None = None,
    template: Path = TEMPLATE_DIR / "nginx.conf.template",
    error_log: Path | str | None = None,
    limits: Mapping[str, tuple[str, int]] | None = None,
    health_dir: Path | str | None = None,
) -> str:
    """nginx.conf for these ports, with every temporary path in ``workdir`` (the error log too,
    unless ``error_log`` names another file or ``stderr``); ``limits``: the class entries'
    in-flight limits (``class_limits``); ``health_dir``: the watchdog's folder of unhealthy
    models (server/stubs.py; default ``workdir/health``, which stays empty without one)."""
    servers = ports.upstreams()
    # admission_rows is per tritonserver: the whole cluster takes that many per replica.
    limits = {model: (cls, rows * len(servers)) for model, (cls, rows) in (limits or {}).items()}
    values: Mapping[str, object] = {
        "CLASS_LIMIT_ZONES": class_limit_zones(limits),
        "CLASS_LIMIT_CONN": class_limit_conn(limits),
        "WORKERS": workers,
        "WORKDIR": workdir,
        "HEALTH_DIR": health_dir or f"{workdir}/health",
        "ERROR_LOG": error_log or f"{workdir}/nginx-error.log",
        "JS_MODULE": js_module_path or js_module(),
        "JS_PATH": js_path,
        "MAX_BODY_BYTES": max_body_bytes,
        "LISTEN_HOST": ports.listen_host,
        "HTTP_PORT": ports.http,
        "GRPC_LISTEN": f"{ports.grpc_listen_host or ports.listen_host}:{ports.grpc}",
        "METRICS_PORT": ports.metrics,
        "HTTP_SERVERS": upstream_servers(servers, "http"),
        "GRPC_SERVERS": upstream_servers(servers, "grpc"),
        "METRICS_SERVERS": upstream_servers(servers, "metrics", backup=True),
        "UPSTREAM_HOST": ports.upstream_host,
        "TRITON_HTTP_PORT": ports.triton_http,
        "TRITON_GRPC_PORT": ports.triton_grpc,
        "TRITON_METRICS_PORT": ports.triton_metrics,
        "REPOSITORY_UPSTREAM": (
            f"http://{ports.repository_door_address}"
            if ports.repository_door_address
            else f"http://127.0.0.1:{ports.repository_door_port}"
            if ports.repository_door_port
            else "http://triton_http"
        ),
        # docker-compose: readiness from the replicas' probe ports, through the repository door.
        "READY_UPSTREAM": f"http://{ports.repository_door_address}" if ports.repository_door_address else "http://triton_http",
        "STREAM_UPSTREAM": f"http://{ports.stream_door}" if ports.stream_door else "http://triton_http",
        "STREAM_UPSTREAM_LISTEN": ports.stream_upstream_listen or "",
        # Without a cluster, /v2/cluster/ is tritonserver's (which answers it as an unknown path).
        "CLUSTER_UPSTREAM": (
            f"http://127.0.0.1:{ports.repository_door_port}" if ports.repository_door_port else "http://triton_http"
        ),
    }
    text = template.read_text(encoding="utf-8")
    if not ports.stream_upstream_listen:
        text = STREAM_DOOR_BLOCK.sub("\n", text)
    if ports.gateway is None:
        # No gateway behind this front door (make serve runs its own, compose its service).
        text = GATEWAY_BLOCK.sub("\n", text)
    else:
        values = {
            **values,
            "GATEWAY_PORT": ports.gateway.port,
            "GATEWAY_SERVERS": gateway_servers(ports.gateway.servers),
            "GATEWAY_MAX_BODY_BYTES": ports.gateway.max_body_bytes,
        }

    def fill(match: re.Match[str]) -> str:
        if match.group(1) not in values:
            raise FrontDoorError(f"{template.name}: no value for ${{{match.group(1)}}}")
        return str(values[match.group(1)])

    # Only ${UPPER_CASE} is ours; nginx's own $variables pass through.
    return re.sub(r"\$\{([A-Z_]+)\}", fill, text)


def write_bundle(
    out: Path,
    repository: Path,
    ports: FrontDoorPorts,
    *,
    conf_dir: Path | str | None = None,
    workdir: Path | str | None = None,
    js_module_path: Path | str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    workers: int | str = 1,
    error_log: Path | str | None = None,
    health_dir: Path | str | None = None,
    healing_dirs: Sequence[Path | str] = (),
) -> Path:
    """Write ``out/nginx.conf``, ``out/js/infer_check.js`` and ``out/js/limits.js`` (the limits of
    every model in ``repository``); the path of nginx.conf. ``conf_dir`` is where nginx will see
    ``out`` (a container's mount point; default ``out`` itself), ``workdir`` its writable folder."""
    out = Path(out)
    js_dir = out / "js"
    js_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(TEMPLATE_DIR / "infer_check.js", js_dir / "infer_check.js")
    (js_dir / "limits.js").write_text(limits_module(repository, max_body_bytes, health_dir, healing_dirs), encoding="utf-8")
    seen_at = Path(conf_dir) if conf_dir is not None else out
    conf = out / "nginx.conf"
    conf.write_text(
        render(
            ports,
            workdir if workdir is not None else out,
            seen_at / "js",
            max_body_bytes,
            workers,
            js_module_path,
            error_log=error_log,
            limits=class_limits(repository),
            health_dir=health_dir,
        ),
        encoding="utf-8",
    )
    return conf


class FrontDoor:
    """An nginx child process (``daemon off``) whose life is tied to this process."""

    def __init__(
        self,
        ports: FrontDoorPorts,
        workdir: Path,
        repository: Path,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        workers: int | str = 1,
        health_dir: Path | None = None,
        healing_dirs: Sequence[Path] = (),
    ):
        self.ports = ports
        self.healing_dirs = tuple(healing_dirs)
        self.workdir = Path(workdir) / "frontdoor"
        self.health_dir = Path(health_dir) if health_dir is not None else self.workdir / "health"
        self.repository = repository
        self.max_body_bytes = max_body_bytes
        self.workers = workers
        # nginx writes its own error log (-e); SIGTERM on our death is its fast shutdown: the
        # master stops its workers, then exits.
        self.child = ChildProcess("nginx", self.log_path, output=DISCARD, tie="SIGTERM")

    @property
    def process(self):
        """nginx master's subprocess.Popen (None before start)."""
        return self.child.process

    @property
    def conf_path(self) -> Path:
        return self.workdir / "nginx.conf"

    @property
    def log_path(self) -> Path:
        return self.workdir / "nginx-error.log"

    def prepare(self) -> list[str]:
        """Write nginx.conf, the njs script and its limits; the nginx command line."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.workdir / name).mkdir(exist_ok=True)
        self.health_dir.mkdir(parents=True, exist_ok=True)
        write_bundle(
            self.workdir,
            self.repository,
            self.ports,
            max_body_bytes=self.max_body_bytes,
            workers=self.workers,
            js_module_path=js_module(),
            health_dir=self.health_dir,
            healing_dirs=self.healing_dirs,
        )
        return [nginx_binary(), "-p", str(self.workdir), "-c", str(self.conf_path), "-e", str(self.log_path)]

    def check(self) -> None:
        """``nginx -t`` on the generated configuration (raises FrontDoorError with its output)."""
        cmd = self.prepare() + ["-t", "-q"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise FrontDoorError(f"nginx -t failed:\n{done.stdout}{done.stderr}")

    def start(self) -> FrontDoor:
        self.child.start(self.prepare())
        return self

    def running(self) -> bool:
        return self.child.running()

    def reload(self) -> None:
        """Re-render nginx.conf from ``ports`` (e.g. a replica marked down or back), check it,
        and SIGHUP the master: new workers take the new configuration, the old ones finish
        their in-flight requests first."""
        self.check()
        if not self.running():
            raise FrontDoorError("nginx is not running")
        self.child.send_signal(signal.SIGHUP)

    def log_tail(self, lines: int = 20) -> str:
        return self.child.log_tail(lines)

    def stop(self, timeout: float = 10.0, graceful: bool = True) -> int | None:
        """SIGQUIT (finish in-flight requests, then exit) or SIGTERM; SIGKILL to its workers
        too after ``timeout``, and to any worker left after the master's exit."""
        return self.child.stop(timeout, signal.SIGQUIT if graceful else signal.SIGTERM, kill_group=True, reap_group=True)


def ports_in_use(host: str, ports: Iterable[int]) -> list[int]:
    import socket

    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex((host if host not in ("0.0.0.0", "") else "127.0.0.1", port)) == 0:
                busy.append(port)
    return busy


def compose_ports(listen: str = "0.0.0.0", upstream: str | Sequence[str] = COMPOSE_UPSTREAMS) -> FrontDoorPorts:
    """The compose front door: 8000/8001/8002 in its container (compose publishes them on the
    host), tritonserver's 8000/8001/8002 on ``upstream`` (one host, or several: each
    ``HOST`` or ``HOST:HTTP:GRPC:METRICS``, every one a server of the upstream blocks)."""
    hosts = [upstream] if isinstance(upstream, str) else list(upstream)
    if len(hosts) == 1 and ":" not in hosts[0]:
        return FrontDoorPorts(listen, 8000, 8001, 8002, hosts[0], 8000, 8001, 8002)
    return FrontDoorPorts.cluster(listen, 8000, 8001, 8002, [Upstream.parse(h) for h in hosts])


def _check_address(option: str, value: str) -> None:
    """A HOST:PORT option of the render command (a compose service name or an address)."""
    host, _, port = value.rpartition(":")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{option} {value!r}: HOST:PORT")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m server.frontdoor", description="Render the front door's nginx configuration for docker-compose."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="write nginx.conf and js/ (infer_check.js, limits.js) into --out")
    r.add_argument("--out", type=Path, required=True, help="folder to write (mounted read-only by compose)")
    r.add_argument(
        "--repository",
        type=Path,
        default=ROOT / "model_repository",
        help="model repository whose configs give the limits (default: model_repository)",
    )
    r.add_argument(
        "--upstream",
        action="append",
        default=None,
        metavar="HOST[:HTTP:GRPC:METRICS]",
        help=f"a tritonserver (repeat for replicas; ports default 8000:8001:8002; default {' '.join(COMPOSE_UPSTREAMS)})",
    )
    r.add_argument("--listen", default="0.0.0.0", help="address nginx listens on in its container (default 0.0.0.0)")
    r.add_argument(
        "--grpc-listen",
        default=None,
        metavar="HOST:PORT",
        help="where nginx's gRPC listener binds instead of LISTEN:8001, when a gRPC door "
        "(server/grpc_door.py) holds the public gRPC port (Kubernetes: 127.0.0.1:8021)",
    )
    r.add_argument(
        "--repository-door",
        default=None,
        metavar="HOST:PORT",
        help="the repository door (python -m server.repository_door) that acts on every replica: "
        "/v2/repository/ goes there instead of to one replica (docker-compose: repository-door:8004)",
    )
    r.add_argument(
        "--stream-door",
        default=None,
        metavar="HOST:PORT",
        help="the gRPC door's HTTP stream listener (server/stream_door.py): generate_stream goes there, which "
        "ends or continues a stream whose stub or replica is lost (docker-compose: grpc-door:8005)",
    )
    r.add_argument(
        "--stream-upstream-listen",
        default=None,
        metavar="HOST:PORT",
        help="with --stream-door: where nginx's internal listener for the stream door's own calls binds, "
        "balancing the replicas (docker-compose: 0.0.0.0:8006)",
    )
    r.add_argument("--mount", default=COMPOSE_MOUNT, help=f"where nginx sees --out (default {COMPOSE_MOUNT})")
    r.add_argument("--js-module", default=IMAGE_JS_MODULE, help=f"njs module path (default the image's, {IMAGE_JS_MODULE})")
    r.add_argument("--workdir", default=COMPOSE_WORKDIR, help=f"nginx's writable folder (default {COMPOSE_WORKDIR})")
    r.add_argument("--error-log", default="stderr", help="error log file, or stderr (default; docker logs)")
    r.add_argument("--workers", default="auto", help="worker_processes (default auto)")
    r.add_argument(
        "--max-body-mb",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES // (1024 * 1024),
        help="larger request bodies get 413 (default 64)",
    )
    args = parser.parse_args(argv)

    try:
        ports = compose_ports(args.listen, args.upstream or list(COMPOSE_UPSTREAMS))
        if args.grpc_listen:
            host, _, port = args.grpc_listen.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--grpc-listen {args.grpc_listen!r}: HOST:PORT")
            ports.grpc_listen_host, ports.grpc = host, int(port)
        for option, value in (
            ("--repository-door", args.repository_door),
            ("--stream-door", args.stream_door),
            ("--stream-upstream-listen", args.stream_upstream_listen),
        ):
            if value is not None:
                _check_address(option, value)
        if args.repository_door:
            ports.repository_door_address = args.repository_door
        if (args.stream_door is None) != (args.stream_upstream_listen is None):
            raise ValueError("--stream-door and --stream-upstream-listen go together")
        ports.stream_door, ports.stream_upstream_listen = args.stream_door, args.stream_upstream_listen
    except (ValueError, FrontDoorError) as exc:
        parser.error(str(exc))
    conf = write_bundle(
        args.out,
        args.repository,
        ports,
        conf_dir=args.mount,
        workdir=args.workdir,
        js_module_path=args.js_module,
        max_body_bytes=args.max_body_mb << 20,
        workers=args.workers,
        error_log=args.error_log,
    )
    models = sorted(model_limits(args.repository))
    servers = ", ".join(f"{u.host}:{u.http}" for u in ports.upstreams())
    print(
        f"front door: wrote {conf} and {args.out / 'js'} (limits of {len(models)} models: {', '.join(models)}; "
        f"upstream {servers})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
