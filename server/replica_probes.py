"""Which replicas are starting, from their probe ports: what docker-compose's gRPC door knows in place of
serve-cluster's starting file.

A replica that restarts opens tritonserver's ports before it has loaded what its rollout state defers
(server/repository_prep.py), so for a while it answers NOT_FOUND for a model of the repository. Under
serve-cluster the cluster writes a file while a listed replica is not ready; in compose each replica's
launcher answers ``GET /v2/health/ready`` on its probe port (server/health_port.py). ``ReplicaProbes``
polls those in a thread and says whether any replica is not ready now: the gRPC door then resends such a
NOT_FOUND (nothing ran) for a few seconds, so that nginx takes it to a replica that has the model.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Sequence

POLL_S = 0.5


class ReplicaProbes:
    def __init__(self, urls: Sequence[str], poll_s: float = POLL_S, timeout_s: float = 1.0):
        self.urls = tuple(urls)
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self._not_ready: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._watch, args=(u,), name=f"probe {u}", daemon=True) for u in self.urls]

    def start(self) -> ReplicaProbes:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def starting(self) -> bool:
        """A replica whose probe does not answer 200 now (starting, loading, or down)."""
        with self._lock:
            return bool(self._not_ready)

    def not_ready(self) -> list[str]:
        with self._lock:
            return sorted(self._not_ready)

    def ready(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _watch(self, url: str) -> None:
        while not self._stop.is_set():
            ok = self.ready(url)
            with self._lock:
                (self._not_ready.discard if ok else self._not_ready.add)(url)
            self._stop.wait(self.poll_s)
