"""Locust load test of the text_embedding ensemble (`make locust`), tritonclient users over HTTP and gRPC.

Each simulated user sends one 16-token sentence (perf/data/sentences_16tok.json) per request, waits
for the answer and reports its latency to Locust; ``--host`` is http://host:port (TritonHttpUser) or
grpc://host:port (TritonGrpcUser):

    locust -f perf/bench/locustfile.py --headless -u 32 -r 8 -t 60s --host http://127.0.0.1:8000 TritonHttpUser

perf_analyzer measures more precisely; Locust shows how the service holds up under many independent
clients with ramp-up. Locust loads this file by path, so it reads its input without the perf package.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

import gevent
import numpy as np
from locust import User, between, events, task

DATA = Path(__file__).resolve().parents[1] / "data" / "sentences_16tok.json"
SENTENCES = [item["TEXT"]["content"][0] for item in json.loads(DATA.read_text())["data"]]
MODEL = "text_embedding"


def _url(host: str | None, default_port: int) -> str:
    parsed = urlparse(host if host and "://" in host else f"x://{host or '127.0.0.1'}")
    return f"{parsed.hostname or '127.0.0.1'}:{parsed.port or default_port}"


def _call_here(func, args=(), kwds=None):
    """Run a client call in this greenlet (the HTTP client, geventhttpclient, is cooperative)."""
    return func(*args, **(kwds or {}))


class _TritonUser(User):
    abstract = True
    wait_time = between(0.0, 0.01)
    protocol = ""
    module: ModuleType | None = None  # tritonclient.http or tritonclient.grpc, set by connect()
    infer_options: dict[str, Any] = {}  # the infer call's keywords (replaced, never mutated)
    # How a client call runs: here, or on gevent's pool of real threads (the gRPC user's connect()).
    blocking: Callable[..., Any] = staticmethod(_call_here)

    def on_start(self) -> None:
        self.client = self.connect()

    def on_stop(self) -> None:
        self.blocking(self.client.close)

    def connect(self):  # pragma: no cover - defined by subclasses
        raise NotImplementedError

    @task
    def embed_one_sentence(self) -> None:
        assert self.module is not None  # on_start() connected
        inp = self.module.InferInput("TEXT", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[random.choice(SENTENCES).encode()]], dtype=object))
        start, exception, size = time.perf_counter(), None, 0
        try:
            out = self.blocking(self.client.infer, (MODEL, [inp]), self.infer_options).as_numpy("EMBEDDING")
            if out is None or out.shape != (1, 384):
                raise ValueError(f"unexpected EMBEDDING {None if out is None else out.shape}")
            size = out.nbytes
        except Exception as exc:  # noqa: BLE001 - every failure is reported to Locust
            exception = exc
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        events.request.fire(
            request_type=self.protocol,
            name=MODEL,
            response_time=elapsed_ms,
            response_length=size,
            exception=exception,
            context={},
        )


class TritonHttpUser(_TritonUser):
    protocol = "http"

    def connect(self):
        import tritonclient.http as httpclient  # geventhttpclient: cooperative under Locust

        self.module = httpclient
        return httpclient.InferenceServerClient(_url(self.host, 8000), connection_timeout=10, network_timeout=30)


class TritonGrpcUser(_TritonUser):
    protocol = "grpc"

    def connect(self):
        import tritonclient.grpc as grpcclient

        self.infer_options = {"client_timeout": 30.0}  # a stuck call fails, the run ends on time
        # Blocking gRPC calls run on gevent's pool of real threads while the user's greenlet waits
        # cooperatively. gRPC's own gevent mode (grpc.experimental.gevent.init_gevent) hung CI runs
        # now and then, called per user or once at import.
        self.blocking = gevent.get_hub().threadpool.apply
        self.module = grpcclient
        return grpcclient.InferenceServerClient(_url(self.host, 8001))
