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


def http(url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 120.0) -> tuple[int, bytes]:
    """One HTTP call: (status, body); connection errors give status 0."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
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

    def _json(self, path: str, method: str = "GET", body: Any = None, what: str = "") -> Any:
        status, raw = http(self.base + path, method, body, self.headers, self.timeout)
        if status != 200:
            message = raw.decode(errors="replace")
            try:
                message = json.loads(message).get("error", message)
            except (ValueError, AttributeError):
                pass
            raise RepositoryError(f"{what or method + ' ' + path}: HTTP {status}: {message}", status)
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

    def wait_ready(self, model: str, version: int | None = None, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready(model, version):
            if time.monotonic() > deadline:
                raise RepositoryError(f"{model}{'' if version is None else f' version {version}'} not ready after {timeout:.0f} s")
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

    def metrics(self) -> str:
        if not self.metrics_url:
            return ""
        status, raw = http(self.metrics_url, timeout=10)
        return raw.decode(errors="replace") if status == 200 else ""

    def infer_json(self, model: str, body: dict) -> dict:
        return self._json(f"/v2/models/{model}/infer", "POST", body, what=f"inference on {model}")
