"""How the integration and perf tiers start their real tritonserver (one per tier and session).

Free ports, the project's model repository (each model's FP32 config.pbtxt; exported first
if needed), a readiness poll with a timeout, the server stopped in ``finally``. Its log is
kept, and its last lines are attached to the report of any failed test that used the
``triton`` fixture. Unit tests never start one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from export import generation, image_classifier, text_encoder
from server.deployment import Deployment, DeploymentOptions
from server.layout import ROOT
from server.process import ServerError

REPOSITORY = ROOT / "model_repository"
_RUNNING: list[Deployment] = []  # for attaching the log to failed tests' reports


@functools.cache
def _exported() -> None:
    """The repository's models exported, checked at the session's first start (a check hashes
    the model files: half a second, for each of the session's many starts otherwise)."""
    if not text_encoder.up_to_date(REPOSITORY):
        text_encoder.export(REPOSITORY)
    for image_model in image_classifier.MODELS.values():
        if not image_classifier.up_to_date(REPOSITORY, model=image_model):
            image_classifier.export(REPOSITORY, model=image_model)
    if (REPOSITORY / generation.MODEL / "config.pbtxt").is_file() and not generation.up_to_date(REPOSITORY):
        generation.export_for_serving(REPOSITORY)


@contextlib.contextmanager
def _serve(prefix: str, models: tuple[str, ...] | None = None, **options):
    _exported()
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    extra = {"models": models} if models else {}
    # The monitored form (as serve-cluster, compose and Kubernetes run it): the rules' quantiles exist.
    # drain 5 s, not the launcher's 30: nothing here drains longer requests.
    options = {
        "model_repository": REPOSITORY,
        "workdir": workdir,
        "summary_latencies": True,
        "drain_timeout": 5,
        **extra,
        **options,
    }
    deployment = Deployment(DeploymentOptions.with_free_ports(**options))
    deployment.start()
    _RUNNING.append(deployment)
    try:
        try:
            deployment.wait_ready(timeout=float(os.environ.get("TRITON_READY_TIMEOUT", "300")))
        except ServerError as exc:
            pytest.fail(f"{exc}\n--- server log ---\n{exc.log_tail}", pytrace=False)
        yield deployment
    finally:
        _RUNNING.remove(deployment)
        deployment.stop()
        if os.environ.get("TRITON_KEEP_WORKDIR") != "1":
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def start_triton():
    """``with start_triton(prefix, models, **options) as server``: each tier starts its own
    server, a server.deployment.Deployment of one tritonserver behind its doors (the perf tier
    needs one whose statistics no other test has touched); options are DeploymentOptions fields
    (cache_size_bytes, env, model_repository, front_door, ...)."""
    return _serve


# Under `make test` and `make test-perf` (STRICT_SKIPS=1, set by the Makefile) a test may skip only
# for what no set-up provides: a GPU or TensorRT, a CPU feature, a kernel facility. A skip for
# anything scripts/setup.sh installs or `make export` builds (nginx, promtool, wrk, a package, an
# exported model) means a broken set-up, and fails instead of reading green.
HARDWARE_SKIPS = re.compile(
    r"GPU|CUDA|nvidia|TensorRT|on this CPU|this CPU has no|fbgemm|dmesg|kernel log|root and unshare|PR_SET_PDEATHSIG",
    re.IGNORECASE,
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "network: asks a package registry over the network (`-m 'not network'` leaves it out; "
        "an unreachable registry skips, and fails under STRICT_SKIPS=1)",
    )


def skip_reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def skip_fails_when_strict(reason: str) -> bool:
    """Whether a skip for ``reason`` fails under STRICT_SKIPS=1: anything but hardware and kernel."""
    return HARDWARE_SKIPS.search(reason) is None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and "triton" in getattr(item, "fixturenames", ()):
        for server in _RUNNING:
            report.sections.append(("tritonserver log (last lines)", server.log_tail(80)))
    if report.skipped and os.environ.get("STRICT_SKIPS") == "1" and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if skip_fails_when_strict(reason):
            report.outcome = "failed"
            report.longrepr = f"skipped, but the set-up of make test provides what it needs (STRICT_SKIPS=1): {reason}"


@pytest.fixture
def redis_server():
    """A real redis-server on a free port (server/redis_process.py), stopped after the test;
    the test may kill(), restart(), pause() and resume() it."""
    from server.redis_process import RedisProcess

    with RedisProcess() as redis:
        yield redis


@pytest.fixture(scope="session")
def repository_configs(tmp_path_factory) -> Path:
    """model_repository's configs with the priority-class lanes, which `make export` renders
    (export/lanes.py) and a fresh clone lacks: the repository itself once exported, else a copy
    of every config.pbtxt with the lanes rendered into it (the unit tier needs no export)."""
    from export.lanes import declared_lanes, render_all

    configs = sorted(REPOSITORY.glob("*/config.pbtxt"))
    lanes = [lane.name for c in configs for lane in declared_lanes(c.parent.name, c.read_text())]
    assert lanes, "no model declares a priority-class lane: the lane checks would check nothing"
    if all((REPOSITORY / name / "config.pbtxt").is_file() for name in lanes):
        return REPOSITORY
    copy = tmp_path_factory.mktemp("configs") / "model_repository"
    for c in configs:
        (copy / c.parent.name).mkdir(parents=True)
        shutil.copyfile(c, copy / c.parent.name / "config.pbtxt")
    render_all(copy)
    return copy
