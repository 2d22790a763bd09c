"""Integration tier: marker and tritonclient fixtures on the session's server (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def trace_file(tmp_path_factory):
    """Where the session's server writes traces; tracing is off until a test turns it on
    (POST /v2/trace/setting), since the file cannot be set over the network."""
    return tmp_path_factory.mktemp("trace") / "trace.json"


@pytest.fixture(scope="session")
def triton(start_triton, trace_file):
    """The running server (a server.deployment.Deployment of one tritonserver behind its doors):
    .http_url, .grpc_url, .metrics_url; .triton is the tritonserver itself."""
    tracing = (
        f"--trace-config=triton,file={trace_file}",
        "--trace-config=level=OFF",
        "--trace-config=rate=1",
        "--trace-config=count=-1",
        "--trace-config=log_frequency=1",
    )
    with start_triton("triton-it-", extra_args=tracing) as server:
        yield server


@pytest.fixture(scope="session")
def reranker_repository(tmp_path_factory):
    """(repository, checkpoint): a copy of the model repository with text_reranker exported from a
    random-init checkpoint (tests/integration/reranker_repository.py), made once for the modules
    that serve it (they only read it)."""
    from tests.integration.reranker_repository import export_reranker

    return export_reranker(tmp_path_factory.mktemp("reranker"))


@pytest.fixture(scope="session")
def reranker_server(start_triton, reranker_repository):
    """A server of the reranker repository: text_reranker beside text_embedding and
    text_embedding_cached, started once for the modules that serve the reranker
    (test_openai_gateway_cross_encoder, test_reranker: they send requests and read counter deltas)."""
    repo, _ = reranker_repository
    models = ("text_embedding", "text_embedding_cached", "text_reranker")
    with start_triton("triton-reranker-", models, model_repository=repo) as server:
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


GATEWAY_TEST_KEY = "sk-test-gateway-key-0123456789"


@pytest.fixture(scope="session")
def start_gateway(tmp_path_factory):
    """``with start_gateway(triton_grpc_url, *extra_args, env=...) as gw``: an OpenAI gateway
    (python -m openai_gateway) on a free port with the key ``GATEWAY_TEST_KEY``; ``gw.url``,
    ``gw.log_tail()``, ``gw.log_path``. Waits for /health (up), not for readiness, so a
    gateway in front of a dead Triton can be tested too."""
    import contextlib
    import time

    from server.gateway import GatewayOptions, GatewayProcess
    from server.process import free_port

    @contextlib.contextmanager
    def start(triton_grpc_url: str, *extra_args: str, env: dict | None = None, wait_ready: bool = True):
        workdir = tmp_path_factory.mktemp("gateway-")
        options = GatewayOptions(
            triton_grpc_url=triton_grpc_url,
            port=free_port(),
            workdir=workdir,
            api_key_file=workdir / "gateway-api-key",
            extra_args=list(extra_args),
            # Each its own Batch API store (not the repository's .triton/batches).
            env={"GATEWAY_API_KEYS": GATEWAY_TEST_KEY, "GATEWAY_BATCH_DIR": str(workdir / "batches"), **(env or {})},
            drain_timeout=5,
        )
        gw = GatewayProcess(options).start()
        try:
            if wait_ready:
                gw.wait_ready(timeout=60)
            else:
                deadline = time.monotonic() + 30
                while gw.status("/health") != 200:
                    if not gw.running() or time.monotonic() > deadline:
                        pytest.fail(f"the gateway did not start:\n{gw.log_tail()}", pytrace=False)
                    time.sleep(0.1)
            yield gw
        finally:
            gw.stop()

    return start


@pytest.fixture(scope="session")
def gateway(triton, start_gateway):
    """The OpenAI gateway in front of the session's server (default settings, rate limit off so
    tests do not trip over it; the rate limit has its own gateway in its tests)."""
    with start_gateway(triton.triton_grpc_url, "--rate-limit", "0") as gw:
        yield gw


@pytest.fixture(scope="session")
def openai_client(gateway):
    """The official ``openai`` SDK pointed at the gateway (no retries: a failure shows at once)."""
    import openai

    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=GATEWAY_TEST_KEY, max_retries=0, timeout=120)
    yield client
    client.close()


def unload_and_wait(client, *models: str, timeout: float = 120.0) -> None:
    """Unload ``models`` from the session's server and wait until it is ready again: Triton
    unloads in the background, and its (strict) server readiness is false until every unload
    finished, so the next test's readiness probe would see 400."""
    import time

    for model in models:
        client.unload_model(model)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {m["name"]: m.get("state") for m in client.get_model_repository_index() if m["name"] in models}
        if all(states.get(m) in (None, "UNAVAILABLE") for m in models) and client.is_server_ready():
            return
        time.sleep(0.2)
    raise AssertionError(f"the server is not ready {timeout:.0f} s after unloading {', '.join(models)}")
