"""The servers a side-by-side benchmark starts, one per phase (each from its repository, e.g. a
``linked_repository`` with changed configs): started together, waited for together, measured in
``interleaved`` rounds and stopped together with their logs kept in the results folder
(``<name>-<phase>.log``); ``side_by_side`` does all of it around a block, in a scratch folder."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from perf.lib.paths import REPOSITORY


class _Server(Protocol):
    @property
    def log_path(self) -> Path: ...

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


def start(repositories: Mapping[str, Path], models: Sequence[str], workdir: Path, say: Callable[[str], None], **options) -> dict:
    """One tritonserver per phase (``repositories``: phase -> the repository it serves), started side
    by side without a front door (perf.lib.deployment.server_deployment; ``options`` are DeploymentOptions');
    wait with ``wait_ready`` and stop with ``stop``."""
    from perf.lib.deployment import server_deployment

    servers = {}
    try:
        for phase, repository in repositories.items():
            token = secrets.token_urlsafe(16)
            servers[phase] = server_deployment(
                models, workdir / phase, model_repository=repository, repository_token=token, front_door=False, **options
            )
            say(
                f"starting tritonserver for {phase} ({', '.join(models)}; --model-config-name={options.get('model_config_name')})"
            )
            servers[phase].start()
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


@contextlib.contextmanager
def side_by_side(
    phases: Sequence[str],
    models: Sequence[str],
    out_dir: Path,
    say: Callable[[str], None],
    before: Callable[[Path, Path], Path],
    **options,
) -> Iterator[tuple[dict[str, Any] | None, Path]]:
    """A scratch folder and one tritonserver per phase (``start``): ``after`` serves the model repository,
    any other phase the copy ``before(repository, target)`` makes in the folder. Yields the servers, ready
    (None when one is not: said why), and the folder; then stops them (``stop``) and removes the folder."""
    workdir = Path(tempfile.mkdtemp(prefix="perf-"))
    servers: dict[str, Any] = {}
    try:
        repositories = {p: REPOSITORY if p == "after" else before(REPOSITORY, workdir / f"repository-{p}") for p in phases}
        servers = start(repositories, models, workdir, say, **options)
        yield (servers if wait_ready(servers, say, indent="    ") else None), workdir
    finally:
        stop(servers, out_dir)
        shutil.rmtree(workdir, ignore_errors=True)


def interleaved(phases: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round from 1, phase) in the order a side-by-side run measures them: A B, then B A, ..."""
    for rnd in range(rounds):
        for phase in phases if rnd % 2 == 0 else phases[::-1]:
            yield rnd + 1, phase


def linked_repository(source: Path, target: Path, config: Callable[[str, str, str], str | None]) -> Path:
    """A repository at ``target`` serving ``source``'s models: config.pbtxt and configs/*.pbtxt are
    written as ``config(model, relative path, text)`` returns them, the rest (and a config it
    returns None for) linked."""
    for model_dir in sorted(p for p in source.iterdir() if (p / "config.pbtxt").is_file()):
        for path in sorted(model_dir.iterdir()) + sorted(model_dir.glob("configs/*.pbtxt")):
            relative = str(path.relative_to(model_dir))
            out = target / model_dir.name / relative
            out.parent.mkdir(parents=True, exist_ok=True)
            is_config = relative == "config.pbtxt" or relative.startswith("configs/")
            text = config(model_dir.name, relative, path.read_text()) if is_config else None
            if text is not None:
                out.write_text(text)
            elif relative != "configs" or not path.is_dir():
                out.symlink_to(path.resolve(), target_is_directory=path.is_dir())
    return target
