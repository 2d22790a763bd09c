"""The argv of `python -m server` as the launcher tests run it: this interpreter, a work folder in the
test's tmp_path and the public ports of ``ports``, then the test's own options."""

from __future__ import annotations

import sys
from pathlib import Path

from server.process import ServerOptions


def launcher_command(tmp_path: Path, ports: ServerOptions, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "server",
        "--workdir",
        str(tmp_path / "work"),
        "--http-port",
        str(ports.http_port),
        "--grpc-port",
        str(ports.grpc_port),
        "--metrics-port",
        str(ports.metrics_port),
        *args,
    ]
