"""Clients that never retry, for the tests that kill things under load: keep-alive
``http.client`` connections through the front door (as curl, wrk, browsers and ``requests``
use it) and tritonclient gRPC through the gRPC door, each in its own thread, sending one text
to ``text_embedding`` until stopped. Every outcome is counted; subclasses say how an answer is
labelled (``http_outcome``, ``grpc_outcome``, ``grpc_error``)."""

from __future__ import annotations

import collections
import http.client
import json
import threading

import numpy as np


class PlainClients:
    def __init__(
        self,
        http_url: str,
        grpc_url: str,
        http_threads: int = 8,
        grpc_threads: int = 4,
        text: str = "plain",
        model: str = "text_embedding",
    ):
        self.http_url, self.grpc_url, self.text, self.model = http_url, grpc_url, text, model
        self.stop = threading.Event()
        self.outcomes: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._http, daemon=True) for _ in range(http_threads)]
        self.threads += [threading.Thread(target=self._grpc, daemon=True) for _ in range(grpc_threads)]

    # -- labels (subclasses refine them)
    def http_outcome(self, status: int, raw: bytes) -> str:
        return f"http {status}"

    def grpc_outcome(self, result) -> str:
        return "grpc OK"

    def grpc_error(self, exc) -> str:
        return f"grpc {exc.status()}"

    # -- the clients
    def _count(self, key: str) -> None:
        with self.lock:
            self.outcomes[key] += 1

    def _http(self) -> None:
        host, port = self.http_url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [self.text]}]})
        while not self.stop.is_set():
            try:
                conn.request("POST", f"/v2/models/{self.model}/infer", body)
                response = conn.getresponse()
                self._count(self.http_outcome(response.status, response.read()))
            except (OSError, http.client.HTTPException) as exc:
                self._count(f"http {type(exc).__name__}")
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=60)

    def _grpc(self) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.grpc_url)
        tensor = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[self.text.encode()]], dtype=object))
        while not self.stop.is_set():
            try:
                self._count(self.grpc_outcome(client.infer(self.model, [tensor], client_timeout=60)))
            except grpcclient.InferenceServerException as exc:
                self._count(self.grpc_error(exc))
        client.close()

    def take(self) -> collections.Counter:
        """The outcomes since the last take."""
        with self.lock:
            out, self.outcomes = self.outcomes, collections.Counter()
        return out

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)
