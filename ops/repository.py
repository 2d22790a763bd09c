"""Triton's repository API (load, unload, config) and the statistics a rollout reads, over HTTP.

The repository API is restricted (``--http-restricted-api`` / ``--grpc-restricted-protocol``)
to requests carrying the header ``triton-repository-token: <token>`` (gRPC metadata
``triton-grpc-protocol-triton-repository-token``: Triton prefixes it); inference, health,
metadata and statistics stay open. ``python -m server`` creates the token (or reads it):
from ``$TRITON_REPOSITORY_TOKEN``, else the file ``.triton/repository-token`` (mode 0600),
which every client here reads the same way.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOKEN_HEADER = "triton-repository-token"
# Triton 2.51 prefixes the key of a restricted gRPC protocol: gRPC clients send this metadata.
GRPC_TOKEN_HEADER = "triton-grpc-protocol-" + TOKEN_HEADER
TOKEN_ENV = "TRITON_REPOSITORY_TOKEN"
TOKEN_FILE_ENV = "TRITON_REPOSITORY_TOKEN_FILE"
DEFAULT_TOKEN_FILE = ROOT / ".triton" / "repository-token"


class RepositoryError(RuntimeError):
    """Triton refused or failed a repository or statistics call; ``status`` is the HTTP code."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def token_file() -> Path:
    return Path(os.environ.get(TOKEN_FILE_ENV) or DEFAULT_TOKEN_FILE)


def read_token(path: Path | None = None) -> str | None:
    """The repository token: ``$TRITON_REPOSITORY_TOKEN``, else the token file, else None."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    path = Path(path) if path is not None else token_file()
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return token or None


def ensure_token(path: Path | None = None) -> str:
    """The token the launcher protects the repository API with: ``$TRITON_REPOSITORY_TOKEN``,
    else the token file's, else a new random one written to the token file (mode 0600)."""
    path = Path(path) if path is not None else token_file()
    token = read_token(path)
    if token:
        return token
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return token


def token_headers(token: str | None = None) -> dict[str, str]:
    """``{TOKEN_HEADER: token}`` for the given token or the one ``read_token`` finds; {} without one."""
    token = token if token is not None else read_token()
    return {TOKEN_HEADER: token} if token else {}


def http(
    url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None, timeout: float = 120.0
) -> tuple[int, bytes]:
    """One HTTP call: (status, body); connection errors give status 0."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc).encode()


class RepositoryClient:
    """Triton's HTTP endpoint: ``url`` is ``host:port`` (or ``http://host:port``)."""

    def __init__(self, url: str, token: str | None = None, metrics_url: str | None = None, timeout: float = 300.0):
        self.base = url if url.startswith("http") else f"http://{url}"
        self.headers = token_headers(token)
        self.metrics_url = metrics_url
        self.timeout = timeout

    def _call(self, path: str, method: str = "GET", body: Any = None, what: str = "") -> bytes:
        """The answer's body; anything but 200 raises RepositoryError with Triton's status and message."""
        status, raw = http(self.base + path, method, body, self.headers, self.timeout)
        if status != 200:
            message = raw.decode(errors="replace")
            try:
                message = json.loads(message).get("error", message)
            except (ValueError, AttributeError):
                pass
            raise RepositoryError(f"{what or method + ' ' + path}: HTTP {status}: {message}", status)
        return raw

    def _json(self, path: str, method: str = "GET", body: Any = None, what: str = "") -> Any:
        raw = self._call(path, method, body, what)
        return json.loads(raw) if raw else {}

    def config(self, model: str) -> dict:
        return self._json(f"/v2/models/{model}/config", what=f"config of {model}")

    def load(self, model: str, config: dict | None = None) -> None:
        """Load (or reload) ``model``; with ``config``, as a config override. Triton answers
        when the load is done (warmup included); the old model serves until then."""
        body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
        self._json(f"/v2/repository/models/{model}/load", "POST", body, what=f"load of {model}")

    def unload(self, model: str) -> None:
        self._json(f"/v2/repository/models/{model}/unload", "POST", {}, what=f"unload of {model}")

    def ready(self, model: str, version: int | None = None) -> bool:
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version is not None else "") + "/ready"
        return http(self.base + path, timeout=10)[0] == 200

    def answers(self) -> bool:
        """Whether the server answers HTTP at all (any status): False when it is down."""
        return http(self.base + "/v2/health/live", timeout=5)[0] != 0

    def wait_ready(self, model: str, version: int | None = None, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready(model, version):
            if time.monotonic() > deadline:
                raise RepositoryError(
                    f"{model}{'' if version is None else f' version {version}'} not ready after {timeout:.0f} s"
                )
            time.sleep(0.2)

    def version_stats(self, model: str) -> dict[int, dict[str, float]]:
        """Per version: cumulative ``success`` and ``fail`` counts and ``success_ns`` (total time)."""
        out = {}
        for s in self._json(f"/v2/models/{model}/stats", what=f"statistics of {model}").get("model_stats", []):
            stats = s.get("inference_stats", {})
            out[int(s["version"])] = {
                "success": float(stats.get("success", {}).get("count", 0)),
                "fail": float(stats.get("fail", {}).get("count", 0)),
                "success_ns": float(stats.get("success", {}).get("ns", 0)),
            }
        return out

    def post(self, path: str, body: bytes) -> bytes:
        """A repository call with a raw JSON body as the caller sent it (the cluster's fan-out
        forwards load and unload this way); a refusal raises RepositoryError with Triton's status."""
        return self._call(path, "POST", body)

    def metrics(self) -> str:
        if not self.metrics_url:
            return ""
        status, raw = http(self.metrics_url, timeout=10)
        return raw.decode(errors="replace") if status == 200 else ""

    def infer_json(self, model: str, body: dict) -> dict:
        return self._json(f"/v2/models/{model}/infer", "POST", body, what=f"inference on {model}")


class ReplicatedRepositoryClient:
    """The same calls as ``RepositoryClient`` on every replica of a cluster (``serve-cluster``),
    so that every replica serves the same versions and a rollout is judged on all their traffic.

    - ``load`` and ``unload`` go to each replica in turn. When replica k refuses, the replicas
      before it are put back as they were (the config they served, or unloaded if they served
      none) and the error names replica k: a load happens on every replica or on none.
    - ``ready`` is true only when every replica says so; ``config`` is the first replica's.
    - ``version_stats`` and the metrics add up the replicas' (metric series keep apart: each
      ``instance`` label gets its replica's name in front).
    - ``infer_json`` asks every replica (a smoke check must pass on each) and returns the last answer.
    """

    def __init__(self, replicas: list[RepositoryClient], names: list[str] | None = None):
        if not replicas:
            raise ValueError("a replicated repository client needs at least one replica")
        self.replicas = list(replicas)
        self.names = list(names) if names else [f"replica {i}" for i in range(len(replicas))]

    @property
    def base(self) -> str:
        return self.replicas[0].base

    def _named(self, index: int, exc: RepositoryError) -> RepositoryError:
        where = getattr(self.replicas[index], "base", "")
        return RepositoryError(f"{self.names[index]}{f' ({where})' if where else ''}: {exc}", exc.status)

    def _served_config(self, client: RepositoryClient, model: str) -> dict | None:
        return client.config(model) if client.ready(model) else None

    def _restore(self, model: str, done: list[tuple[RepositoryClient, dict | None]]) -> list[str]:
        """Put ``done`` replicas back to the config each served before (None: unloaded).
        Returns the replicas that could not be put back (logged by the caller's error)."""
        failed = []
        for client, before in reversed(done):
            try:
                if before is None:
                    client.unload(model)
                else:
                    client.load(model, before)
            except RepositoryError:
                failed.append(self.names[self.replicas.index(client)])
        return failed

    def _each(self, model: str, action: str, call) -> list[str]:
        """``call`` on each replica in turn, all or none (above). A replica that does not answer
        at all (down, restarting) is skipped: it loads its startup models and the rollout
        state when it comes back. Returns the skipped replicas' names."""
        done: list[tuple[RepositoryClient, dict | None]] = []
        skipped = []
        for index, client in enumerate(self.replicas):
            try:
                before = self._served_config(client, model)
                call(client)
            except RepositoryError as exc:
                if exc.status == 0 and not client.answers():
                    skipped.append(self.names[index])
                    continue
                stuck = self._restore(model, done)
                named = self._named(index, exc)
                if done:
                    restored = len(done) - len(stuck)
                    note = f"; {restored} replica(s) before it put back as they were"
                    if stuck:
                        note += f", NOT put back: {', '.join(stuck)}"
                    raise RepositoryError(f"{action} of {model} refused by {named}{note}", exc.status) from exc
                raise named from exc
            done.append((client, before))
        if not done:
            raise RepositoryError(f"{action} of {model}: no replica answers ({', '.join(skipped)})", 0)
        return skipped

    def load(self, model: str, config: dict | None = None) -> list[str]:
        return self._each(model, "load", lambda c: c.load(model, config))

    def unload(self, model: str) -> list[str]:
        return self._each(model, "unload", lambda c: c.unload(model))

    def post(self, model: str, action: str, body: bytes) -> list[str]:
        """``POST /v2/repository/models/<model>/<action>`` with the caller's body on every replica."""
        path = f"/v2/repository/models/{model}/{action}"
        return self._each(model, action, lambda c: c.post(path, body))

    def config(self, model: str) -> dict:
        try:
            return self.replicas[0].config(model)
        except RepositoryError as exc:
            raise self._named(0, exc) from exc

    def ready(self, model: str, version: int | None = None) -> bool:
        """Ready on every replica that answers (one that is down is skipped, as by ``load``)."""
        answering = [c for c in self.replicas if c.ready(model, version) or c.answers()]
        return bool(answering) and all(c.ready(model, version) for c in answering)

    def wait_ready(self, model: str, version: int | None = None, timeout: float = 120.0) -> None:
        for index, client in enumerate(self.replicas):
            try:
                client.wait_ready(model, version, timeout)
            except RepositoryError as exc:
                raise self._named(index, exc) from exc

    def version_stats(self, model: str) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for index, client in enumerate(self.replicas):
            try:
                stats = client.version_stats(model)
            except RepositoryError as exc:
                raise self._named(index, exc) from exc
            for version, figures in stats.items():
                total = out.setdefault(version, {k: 0.0 for k in figures})
                for k, v in figures.items():
                    total[k] = total.get(k, 0.0) + v
        return out

    def metrics(self) -> str:
        texts = []
        for index, client in enumerate(self.replicas):
            prefix = self.names[index].replace(" ", "-").replace('"', "")
            texts.append(client.metrics().replace('instance="', f'instance="{prefix}/'))
        return "\n".join(texts)

    def infer_json(self, model: str, body: dict) -> dict:
        answer: dict = {}
        for index, client in enumerate(self.replicas):
            try:
                answer = client.infer_json(model, body)
            except RepositoryError as exc:
                raise self._named(index, exc) from exc
        return answer


CLUSTER_REPLICAS_PATH = "/v2/cluster/replicas"


# What connect() returns: one server's client, or serve-cluster's (the same calls on every replica).
AnyRepositoryClient = RepositoryClient | ReplicatedRepositoryClient


def connect(url: str, token: str | None = None, metrics_url: str | None = None, timeout: float = 300.0) -> AnyRepositoryClient:
    """A client for the server at ``url``: when it is serve-cluster's front door (it answers
    ``GET /v2/cluster/replicas``), one that acts on every replica directly; else a plain one."""
    plain = RepositoryClient(url, token=token, metrics_url=metrics_url, timeout=timeout)
    status, raw = http(plain.base + CLUSTER_REPLICAS_PATH, headers=plain.headers, timeout=10)
    if status == 401:
        raise RepositoryError(f"{plain.base}: the cluster refused the repository token (HTTP 401)", 401)
    if status != 200:
        return plain
    try:
        replicas = json.loads(raw)["replicas"]
        names = [r["name"] for r in replicas]
        clients = [RepositoryClient(r["http"], token=token, metrics_url=r["metrics"], timeout=timeout) for r in replicas]
    except (ValueError, KeyError, TypeError) as exc:
        raise RepositoryError(f"{plain.base}{CLUSTER_REPLICAS_PATH}: not a replica list ({exc})") from None
    return ReplicatedRepositoryClient(clients, names)
