"""The OpenAI-compatible gateway (``openai_gateway``) as a child process of the launcher.

It talks to tritonserver's own gRPC port (internal, behind the front door): it builds every
Triton request itself, from requests it has checked, so the front door has nothing to add.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from server.layout import ROOT
from server.supervisor import ChildProcess, NotReady, Service, http_status

log = logging.getLogger(__name__)

DEFAULT_PORT = 8080


class GatewayError(RuntimeError):
    pass


@dataclass
class GatewayOptions:
    triton_grpc_url: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    model_repository: Path = ROOT / "model_repository"
    api_key_file: Path = ROOT / ".triton" / "gateway-api-key"
    workdir: Path = ROOT / ".triton"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    drain_timeout: float = 30.0


class GatewayProcess(Service):
    def __init__(self, options: GatewayOptions):
        self.options = options
        self.child = ChildProcess("the gateway", self.log_path, tie="SIGTERM")

    @property
    def process(self) -> subprocess.Popen | None:
        """The gateway's subprocess.Popen (None before start)."""
        return self.child.process

    @property
    def url(self) -> str:
        o = self.options
        host = "127.0.0.1" if o.host in ("0.0.0.0", "") else o.host
        return f"http://{host}:{o.port}"

    @property
    def log_path(self) -> Path:
        return Path(self.options.workdir) / f"gateway-{self.options.port}.log"

    @property
    def key_source(self) -> str:
        merged = {**os.environ, **self.options.env}
        return "$GATEWAY_API_KEYS" if merged.get("GATEWAY_API_KEYS", "").strip() else str(self.options.api_key_file)

    def command(self) -> list[str]:
        o = self.options
        return [
            sys.executable,
            "-m",
            "openai_gateway",
            "--host",
            o.host,
            "--port",
            str(o.port),
            "--triton",
            o.triton_grpc_url,
            "--model-repository",
            str(o.model_repository),
            "--api-key-file",
            str(o.api_key_file),
            "--drain-timeout",
            str(o.drain_timeout),
            *o.extra_args,
        ]

    def start(self) -> GatewayProcess:
        env = {**os.environ, **self.options.env, "PYTHONUNBUFFERED": "1"}
        self.child.start(self.command(), env=env, cwd=ROOT)
        return self

    def running(self) -> bool:
        return self.child.running()

    def status(self, path: str, timeout: float = 2.0) -> int:
        """The HTTP status of a GET of ``path`` on the gateway; 0 when it does not answer."""
        return http_status(self.url + path, timeout)

    def wait_ready(self, timeout: float = 60.0, should_stop=lambda: False) -> None:
        """Until ``/health/ready`` answers 200 (the gateway is up and sees Triton's models ready)."""
        try:
            self.child.wait_ready(lambda: self.status("/health/ready") == 200, timeout, should_stop=should_stop)
        except NotReady as exc:
            if exc.why == "exited":
                raise GatewayError(f"the gateway exited with code {exc.returncode}:\n{self.log_tail()}") from None
            raise GatewayError(f"the gateway was not ready within {timeout:.0f} s:\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 30) -> str:
        return self.child.log_tail(lines)

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (uvicorn stops accepting and lets in-flight requests finish), SIGKILL after ``timeout``."""
        return self.child.stop(self.options.drain_timeout + 5 if timeout is None else timeout)
