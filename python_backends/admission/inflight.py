"""Rows in flight per priority class, shared by the processes of one tritonserver.

Each process (an entry model's instance) owns one cell of a small file: its pid, its start
time and the rows and batches it has in its lane now. Admission sums the cells of live
processes under an exclusive ``flock`` of the file, so the instances of all entries of a class
see one count; a process that dies leaves a cell whose process is gone (the pid, or a reused
pid with another start time), which is ignored and reused. Nothing to clean up.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import tempfile
from pathlib import Path

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_CELL = struct.Struct("<qqqq")  # pid, start time (clock ticks after boot), rows, batches
CELLS = 128


def server_scope() -> str:
    """A name per tritonserver: a Python stub's parent process is the server."""
    return f"server-{os.getppid()}"


def default_directory(scope: str | None = None) -> Path:
    base = Path(os.environ.get("TRITON_ADMISSION_DIR") or Path(tempfile.gettempdir()) / "triton-admission")
    return base / _SAFE.sub("_", scope or server_scope())


def start_time(pid: int) -> int:
    """The process's start time in clock ticks after boot (/proc/<pid>/stat field 22); 0 if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _alive(pid: int, started: int) -> bool:
    return pid > 0 and started > 0 and start_time(pid) == started


class SharedInflight:
    """The rows in flight of one class (``name``) across processes, at most ``limit``, in at
    most ``max_batches`` batches (fewer than the entry's instances, so one instance is always
    free to answer hits and refuse at once)."""

    def __init__(self, directory: Path, name: str, limit: int, max_batches: int = 1 << 30, pid: int | None = None):
        if limit < 1 or max_batches < 1:
            raise ValueError(f"in-flight limits of {name!r} must be >= 1, got {limit} rows, {max_batches} batches")
        self.name, self.limit, self.max_batches = name, limit, max_batches
        self.pid = pid or os.getpid()
        self.started = start_time(self.pid)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(Path(directory) / f"{_SAFE.sub('_', name)}.inflight", os.O_RDWR | os.O_CREAT, 0o600)
        self.own = self.own_batches = 0
        with self._locked():
            cells = self._read()
            free = next(
                (i for i, (p, s, _, _) in enumerate(cells) if (p, s) == (self.pid, self.started) or not _alive(p, s)), None
            )
            if free is None:
                raise RuntimeError(f"{name}: more than {CELLS} processes share one in-flight count")
            self._cell = free
            self._write_own(0, 0)

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"in-flight count {self.name!r} is closed")
        return self._fd

    def _locked(self):
        fd = self.fd

        class _Lock:
            def __enter__(self):
                fcntl.flock(fd, fcntl.LOCK_EX)

            def __exit__(self, *exc):
                fcntl.flock(fd, fcntl.LOCK_UN)

        return _Lock()

    def _read(self) -> list[tuple[int, int, int, int]]:
        raw = os.pread(self.fd, _CELL.size * CELLS, 0).ljust(_CELL.size * CELLS, b"\0")
        return [_CELL.unpack_from(raw, i * _CELL.size) for i in range(CELLS)]

    def _write_own(self, rows: int, batches: int) -> None:
        os.pwrite(self.fd, _CELL.pack(self.pid, self.started, rows, batches), self._cell * _CELL.size)
        self.own, self.own_batches = rows, batches

    def total(self) -> tuple[int, int]:
        """(rows, batches) in flight of live processes (this one included)."""
        with self._locked():
            return self._total(self._read())

    def _total(self, cells) -> tuple[int, int]:
        live = [(r, b) for i, (p, s, r, b) in enumerate(cells) if b > 0 and (i == self._cell or _alive(p, s))]
        return sum(r for r, _ in live), sum(b for _, b in live)

    def try_add(self, rows: int) -> bool:
        """Count a batch of ``rows`` more in flight unless that passes a limit; an empty lane
        always admits (a batch larger than the row limit is not starved)."""
        with self._locked():
            total, batches = self._total(self._read())
            if batches and (total + rows > self.limit or batches >= self.max_batches):
                return False
            self._write_own(self.own + rows, self.own_batches + 1)
            return True

    def remove(self, rows: int) -> None:
        with self._locked():
            self._write_own(max(0, self.own - rows), max(0, self.own_batches - 1))

    def close(self) -> None:
        if self._fd is not None:
            with self._locked():
                self._write_own(0, 0)
            os.close(self._fd)
            self._fd = None
