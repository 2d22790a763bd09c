"""The servers a benchmark starts: waited for together, stopped together with their logs kept in the
results folder (``<name>-<phase>.log``)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol


class _Server(Protocol):
    log_path: Path

    def stop(self) -> object: ...


class _Waitable(Protocol):
    def wait_ready(self, timeout: float) -> object: ...


def wait_ready(servers: Mapping[str, _Waitable], say: Callable[[str], None], indent: str = "", timeout: float = 300) -> bool:
    """Each server ready within ``timeout`` s; False (said why, with its log's tail) at the first that is not."""
    from server.process import ServerError

    for phase, server in servers.items():
        try:
            server.wait_ready(timeout=timeout)
        except ServerError as exc:
            say(f"{indent}{phase}: {exc}\n{exc.log_tail}")
            return False
    return True


def stop(servers: Mapping[str, _Server], out_dir: Path, name: str = "tritonserver") -> None:
    """Stop each server and copy its log to ``out_dir/<name>-<phase>.log``."""
    for phase, server in servers.items():
        server.stop()
        if server.log_path.is_file():
            shutil.copyfile(server.log_path, out_dir / f"{name}-{phase}.log")
