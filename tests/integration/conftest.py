"""Integration tier: marker and tritonclient fixtures on the session's server (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def triton(start_triton):
    """The running server (server.process.TritonServer): .http_url, .grpc_url, .metrics_url."""
    with start_triton("triton-it-") as server:
        yield server


@pytest.fixture(scope="session")
def http_client(triton):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton.http_url, concurrency=8)
    yield client
    client.close()


@pytest.fixture(scope="session")
def grpc_client(triton):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    yield client
    client.close()
