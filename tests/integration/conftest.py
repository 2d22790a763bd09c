"""One real tritonserver per test session, on free ports, with the project's model repository.

The server log is kept; when a test fails its last lines are attached to the report.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from export import image_classifier, text_encoder
from server.layout import ROOT
from server.process import ServerError, ServerOptions, TritonServer

pytestmark = pytest.mark.integration

REPOSITORY = ROOT / "model_repository"
_RUNNING: list[TritonServer] = []  # for attaching the log to failed tests' reports


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def triton():
    """The running server (server.process.TritonServer): .http_url, .grpc_url, .metrics_url."""
    if not text_encoder.up_to_date(REPOSITORY):
        text_encoder.export(REPOSITORY)
    if not image_classifier.up_to_date(REPOSITORY):
        image_classifier.export(REPOSITORY)
    workdir = Path(tempfile.mkdtemp(prefix="triton-it-"))
    options = ServerOptions.with_free_ports(model_repository=REPOSITORY, workdir=workdir)
    server = TritonServer(options)
    server.start()
    _RUNNING.append(server)
    try:
        try:
            server.wait_ready(timeout=float(os.environ.get("TRITON_READY_TIMEOUT", "300")))
        except ServerError as exc:
            pytest.fail(f"{exc}\n--- server log ---\n{exc.log_tail}", pytrace=False)
        yield server
    finally:
        _RUNNING.remove(server)
        server.stop()
        if os.environ.get("TRITON_KEEP_WORKDIR") != "1":
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for server in _RUNNING:
            report.sections.append(("tritonserver log (last lines)", server.log_tail(80)))


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
