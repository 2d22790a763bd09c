"""L1: an in-process LRU cache with a time-to-live and a byte budget."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# Bookkeeping per entry besides the vector and the key (dict slot, tuple, array header);
# measured roughly with sys.getsizeof, so the budget tracks real memory, not just payload.
ENTRY_OVERHEAD_BYTES = 200


@dataclass
class L1Stats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # removed to stay within the byte budget (least recently used first)
    expirations: int = 0  # found past their TTL
    entries: int = 0
    bytes: int = 0


class LRUCache:
    """Maps key -> read-only float32 vector. Thread-safe.

    ``max_bytes`` bounds vectors + keys + a fixed per-entry overhead; least recently used
    entries go first. ``ttl_s`` bounds an entry's age (0 = no expiry). ``max_bytes`` 0
    disables the cache (every lookup misses, nothing is stored).
    """

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if max_bytes < 0 or ttl_s < 0:
            raise ValueError(f"max_bytes and ttl_s must be >= 0, got {max_bytes}, {ttl_s}")
        self.max_bytes = int(max_bytes)
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._data: OrderedDict[str, tuple[np.ndarray, float, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = L1Stats()

    @staticmethod
    def entry_bytes(key: str, value: np.ndarray) -> int:
        return int(value.nbytes) + len(key) + ENTRY_OVERHEAD_BYTES

    def get_many(self, keys: Sequence[str]) -> list[np.ndarray | None]:
        now = self._clock()
        out: list[np.ndarray | None] = []
        with self._lock:
            for key in keys:
                entry = self._data.get(key)
                if entry is not None and self.ttl_s and entry[1] <= now:
                    self._drop(key)
                    self.stats.expirations += 1
                    entry = None
                if entry is None:
                    self.stats.misses += 1
                    out.append(None)
                else:
                    self._data.move_to_end(key)
                    self.stats.hits += 1
                    out.append(entry[0])
        return out

    def get(self, key: str) -> np.ndarray | None:
        return self.get_many([key])[0]

    def put_many(self, items: Iterable[tuple[str, np.ndarray]]) -> None:
        if self.max_bytes == 0:
            return
        expires = self._clock() + self.ttl_s if self.ttl_s else float("inf")
        with self._lock:
            for key, value in items:
                vector = np.array(value, dtype=np.float32, copy=True)
                vector.setflags(write=False)  # callers get the cached array itself: nobody may change it
                size = self.entry_bytes(key, vector)
                if size > self.max_bytes:
                    continue
                if key in self._data:
                    self._drop(key)
                self._data[key] = (vector, expires, size)
                self.stats.bytes += size
                self.stats.entries += 1
                while self.stats.bytes > self.max_bytes:
                    oldest = next(iter(self._data))
                    self._drop(oldest)
                    self.stats.evictions += 1

    def put(self, key: str, value: np.ndarray) -> None:
        self.put_many([(key, value)])

    def _drop(self, key: str) -> None:
        _, _, size = self._data.pop(key)
        self.stats.bytes -= size
        self.stats.entries -= 1

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.stats.bytes = 0
            self.stats.entries = 0

    def __len__(self) -> int:
        return len(self._data)
