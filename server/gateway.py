"""The OpenAI-compatible gateway (``openai_gateway``) as a child process of the launcher.

It talks to tritonserver's own gRPC port (internal, behind the front door): it builds every
Triton request itself, from requests it has checked, so the front door has nothing to add.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from server.layout import ROOT
from server.lifetime import tie_to_parent
from server.process import http_status

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


class GatewayProcess:
    def __init__(self, options: GatewayOptions):
        self.options = options
        self.process: subprocess.Popen | None = None
        self._log = None

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
        return [sys.executable, "-m", "openai_gateway", "--host", o.host, "--port", str(o.port),
                "--triton", o.triton_grpc_url, "--model-repository", str(o.model_repository),
                "--api-key-file", str(o.api_key_file), "--drain-timeout", str(o.drain_timeout), *o.extra_args]

    def start(self) -> "GatewayProcess":
        Path(self.options.workdir).mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        env = {**os.environ, **self.options.env, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(self.command(), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                        preexec_fn=tie_to_parent("SIGTERM"))
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def status(self, path: str, timeout: float = 2.0) -> int:
        """The HTTP status of a GET of ``path`` on the gateway; 0 when it does not answer."""
        return http_status(self.url + path, timeout)

    def wait_ready(self, timeout: float = 60.0, should_stop=lambda: False) -> None:
        """Until ``/health/ready`` answers 200 (the gateway is up and sees Triton's models ready)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not should_stop():
            if not self.running():
                raise GatewayError(f"the gateway exited with code {self.process.returncode}:\n{self.log_tail()}")
            if self.status("/health/ready") == 200:
                return
            time.sleep(0.2)
        raise GatewayError(f"the gateway was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (uvicorn stops accepting and lets in-flight requests finish), SIGKILL after ``timeout``."""
        if self.process is None:
            return None
        timeout = self.options.drain_timeout + 5 if timeout is None else timeout
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("the gateway did not stop in %.0f s; killing it", timeout)
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode

    def __enter__(self) -> "GatewayProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
