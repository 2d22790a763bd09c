"""A lower class's encoder steps aside between runs while a higher class has work in its lane.

Separate queues and instances give each class its own place in line, but on a small CPU the
lanes still share the cores: a default-class batch that is running when an interactive request
arrives takes half the CPU from it for the batch's whole length. The ragged path cuts every
batch into short runs (``max_batch_tokens``); before each run, ``YieldTo.wait`` looks at the
rows the watched class has in flight (the count its entries keep for admission,
``SharedInflight``) and, while there are any, waits, at most ``max_wait_s`` per run, so the
lower class is slowed but never stopped. A Python-backend setting: the native backend ignores
it (docs/priority-classes.md).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from python_backends.admission.inflight import _CELL, _SAFE, CELLS, _alive, default_directory


class InflightReader:
    """Rows in flight of one class, read-only (the entries' processes own the cells)."""

    def __init__(self, directory: Path, name: str):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(Path(directory) / f"{_SAFE.sub('_', name)}.inflight", os.O_RDWR | os.O_CREAT, 0o600)

    def rows(self) -> int:
        fd = self._fd
        if fd is None:
            raise ValueError("in-flight reader is closed")
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            raw = os.pread(fd, _CELL.size * CELLS, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        total = 0
        for i in range(len(raw) // _CELL.size):
            pid, started, rows, batches = _CELL.unpack_from(raw, i * _CELL.size)
            if batches > 0 and rows > 0 and _alive(pid, started):
                total += rows
        return total

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class YieldTo:
    """``wait()`` before each run: returns the seconds waited (0 when the class is idle)."""

    def __init__(
        self,
        reader: InflightReader,
        max_wait_s: float,
        poll_s: float = 0.001,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if max_wait_s <= 0 or poll_s <= 0:
            raise ValueError(f"yield waits must be > 0, got max {max_wait_s} s, poll {poll_s} s")
        self.reader, self.max_wait_s, self.poll_s = reader, max_wait_s, poll_s
        self._clock, self._sleep = clock, sleep
        self.waited_s = 0.0  # in all, for the log and tests
        self.waits = 0

    def wait(self) -> float:
        if not self.reader.rows():
            return 0.0
        start = self._clock()
        deadline = start + self.max_wait_s
        while self._clock() < deadline:
            self._sleep(min(self.poll_s, max(0.0, deadline - self._clock())))
            if not self.reader.rows():
                break
        waited = self._clock() - start
        self.waited_s += waited
        self.waits += 1
        return waited

    def wrap(self, run: Callable):
        def yielding_run(feed):
            self.wait()
            return run(feed)

        return yielding_run


def yield_from_config(config, directory: Path | None = None) -> YieldTo | None:
    """``yield_to_class`` (a class name) and ``yield_max_ms`` (default 20) of a model's config;
    None when the model does not yield."""
    from python_backends.admission.classes import class_named

    name = config.param("yield_to_class", "")
    if not name:
        return None
    cls = class_named(name, "parameter yield_to_class")
    max_ms = config.param_int("yield_max_ms", 20, minimum=1)
    return YieldTo(InflightReader(directory or default_directory(), cls.name), max_ms / 1000.0)
