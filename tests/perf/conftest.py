"""Perf tier: its own server, loading only text_embedding, with statistics no other test touched."""

import pytest


@pytest.fixture(scope="session")
def triton(start_triton):
    """The running server (server.process.TritonServer): .http_url, .grpc_url, .metrics_url."""
    with start_triton("triton-perf-", ("text_embedding",)) as server:
        yield server
