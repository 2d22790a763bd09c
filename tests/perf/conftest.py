"""One real tritonserver per test session for the perf smoke tests, on free ports.

The same set-up as tests/integration/conftest.py (which a sibling folder cannot import: the
test folders are not packages); the server log is attached to failed tests' reports.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from export import text_encoder
from server.layout import ROOT
from server.process import ServerError, ServerOptions, TritonServer

REPOSITORY = ROOT / "model_repository"
HERE = Path(__file__).resolve().parent
_RUNNING: list[TritonServer] = []


@pytest.fixture(scope="session")
def triton():
    """The running server (server.process.TritonServer): .http_url, .grpc_url, .metrics_url."""
    if not text_encoder.up_to_date(REPOSITORY):
        text_encoder.export(REPOSITORY)
    workdir = Path(tempfile.mkdtemp(prefix="triton-perf-"))
    # The perf smoke runs only drive text_embedding: load just it.
    server = TritonServer(ServerOptions.with_free_ports(model_repository=REPOSITORY, workdir=workdir,
                                                        models=("text_embedding",)))
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # Hooks of a conftest see every test of the session; only ours get this server's log.
    if report.when == "call" and report.failed and Path(item.path).resolve().is_relative_to(HERE):
        for server in _RUNNING:
            report.sections.append(("tritonserver log (last lines)", server.log_tail(80)))
