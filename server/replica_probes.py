"""Which replicas are starting, and which models their watchdogs have marked, from their probe ports:
what docker-compose's gRPC door knows in place of serve-cluster's starting file and health folders.

A replica that restarts opens tritonserver's ports before it has loaded what its rollout state defers
(server/repository_prep.py), so for a while it answers NOT_FOUND for a model of the repository. Under
serve-cluster the cluster writes a file while a listed replica is not ready; in compose each replica's
launcher answers ``GET /v2/health/ready`` on its probe port (server/health_port.py). ``ReplicaProbes``
polls those in a thread and says whether any replica is not ready now: the gRPC door then resends such a
NOT_FOUND (nothing ran) for a few seconds, so that nginx takes it to a replica that has the model.
A replica's not-ready answer lists the models its stub watchdog has marked (a dead stub being
reloaded): the door continues a generation stream that went silent while its model is marked there.

A replica counts as not ready until its first answer. The URLs are checked where they enter
(``probe_url``, the door's argument type).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

POLL_S = 0.5


def probe_url(text: str) -> str:
    """``text`` as a probe port's readiness URL: http://HOST:PORT/PATH."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme != "http" or not parts.hostname or parts.port is None or not parts.path.startswith("/"):
        raise ValueError(f"{text!r}: want http://HOST:PORT/v2/health/ready")
    return text


def probe_answer(url: str, timeout_s: float = 1.0) -> tuple[int, dict[str, str]]:
    """(a probe port's status for ``url``, 0 when it does not answer; the models its watchdog marks,
    with why, from a not-ready answer's ``unhealthy``)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, {}
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read() or b"{}")
        except ValueError:
            body = {}
        unhealthy = body.get("unhealthy") if isinstance(body, dict) else None
        if isinstance(unhealthy, dict):
            return exc.code, {str(m): str(why) for m, why in unhealthy.items()}
        if isinstance(unhealthy, list):
            return exc.code, {str(m): "marked by its stub watchdog" for m in unhealthy}
        return exc.code, {}
    except (urllib.error.URLError, OSError):
        return 0, {}


class ReplicaProbes:
    def __init__(self, urls: Sequence[str], poll_s: float = POLL_S, timeout_s: float = 1.0):
        self.urls = tuple(urls)
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self._not_ready: set[str] = set(self.urls)  # not ready until a replica answers so
        self._marked: dict[str, dict[str, str]] = {}  # url -> the models its watchdog marks, with why
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

    def marked(self, model: str) -> str | None:
        """Why a replica's watchdog has ``model`` marked (its probe's not-ready answer lists it), else None."""
        with self._lock:
            for url, models in self._marked.items():
                if model in models:
                    return f"{models[model]} ({url})"
        return None

    def _watch(self, url: str) -> None:
        while not self._stop.is_set():
            status, marked = probe_answer(url, self.timeout_s)
            with self._lock:
                (self._not_ready.discard if status == 200 else self._not_ready.add)(url)
                self._marked[url] = marked
            self._stop.wait(self.poll_s)
