"""Admission of one entry model's misses into its class's lane.

Before its BLS call a batch adds its rows to the class's in-flight count
(``SharedInflight``); when that would pass the class's limit the batch is refused at once
with UNAVAILABLE (``Overloaded``) instead of waiting. The limit is in rows, not in time: a
closed loop of at most ``limit`` clients is never refused, however slow the machine, while
under an open-loop flood the entry's Triton queue is drained at the speed of a refusal
(microseconds per request) instead of growing, and what is admitted waits behind at most
``limit`` rows of its own class. A refusal needs an instance that is not waiting on the lane:
with full batches, ``limit`` must be at most (instances - 1) x max_batch_size, so an entry
has at least two instances. (tritonserver 2.51's own bounds, ``max_queue_size`` and
queue timeouts, stall its batcher: docs/performance.md.)
"""

from __future__ import annotations

from contextlib import contextmanager

from contract.errors import Overloaded
from python_backends.admission.classes import PriorityClass
from python_backends.admission.inflight import SharedInflight


class Admission:
    def __init__(self, cls: PriorityClass, inflight: SharedInflight):
        self.cls = cls
        self.inflight = inflight
        self.admitted = 0
        self.refused = 0

    @contextmanager
    def rows(self, n: int):
        """Hold ``n`` rows in the lane for the ``with`` body, or raise Overloaded."""
        if not self.inflight.try_add(n):
            self.refused += n
            raise Overloaded(
                f"priority class {self.cls.name!r} is at capacity ({self.inflight.limit} rows in its lane); retry with backoff"
            )
        self.admitted += n
        try:
            yield
        finally:
            self.inflight.remove(n)
