"""clients.generation against a real tritonserver serving text_generation: greedy streams
concatenate to the whole answer, gRPC and HTTP (through the front door) and sync and asyncio
give the same text, stop strings, seeded sampling, the server's INVALID_ARG as one
GenerationError naming the field, cancellation that frees the engine's slot, and the CLI."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from clients.generation import AsyncGenerationClient, GenerationClient, GenerationError
from server.layout import ROOT
from tests.metrics_text import metric_sum, scrape

QUESTION = "What is the capital of France? Answer in one sentence."
GREEDY = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server(triton):
    """The session's server, which loads text_generation with the default models: these tests only
    talk to it, and wait for its engine to be idle where they check that."""
    if not (ROOT / "model_repository" / "text_generation" / "1" / "model.safetensors").exists():
        pytest.skip("text_generation is not exported (python -m export.generation)")
    assert "text_generation" in triton.options.models, triton.options.models
    return triton


def url(server, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


def running_requests(server) -> float:
    """The engine's llm_num_requests_running gauge on the metrics port."""
    return metric_sum(scrape(server.metrics_url), "llm_num_requests_running", series=True)


@pytest.fixture(scope="module")
def reference(server):
    """The greedy answer to QUESTION, whole, over gRPC: what every other path must equal."""
    with GenerationClient(server.grpc_url, "grpc") as client:
        return client.chat(QUESTION, **GREEDY)


def test_reference_answer_is_sane(reference):
    assert reference.text.strip(), "empty answer"
    assert "Paris" in reference.text
    assert reference.finish_reason in ("stop", "length")
    assert 0 < reference.num_output_tokens <= GREEDY["max_tokens"] and reference.num_input_tokens > 10
    assert 0 < reference.time_to_first_token_s <= reference.total_time_s


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_streamed_pieces_concatenate_to_the_whole_answer(server, reference, protocol):
    with GenerationClient(url(server, protocol), protocol) as client:
        whole = client.chat(QUESTION, **GREEDY)
        with client.chat_stream(QUESTION, **GREEDY) as stream:
            pieces = list(stream)
    assert whole.text == reference.text, f"{protocol} whole answer differs from gRPC's"
    assert len(pieces) > 1, "the answer came in one piece: not streamed"
    assert "".join(pieces) == reference.text
    r = stream.result
    assert (r.finish_reason, r.num_input_tokens, r.num_output_tokens) == (
        reference.finish_reason,
        reference.num_input_tokens,
        reference.num_output_tokens,
    )
    assert r.time_to_first_token_s < r.total_time_s


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_asyncio_client_agrees_and_runs_requests_concurrently(server, reference, protocol):
    async def run():
        async with AsyncGenerationClient(url(server, protocol), protocol) as client:
            stream = client.chat_stream(QUESTION, **GREEDY)
            pieces = [p async for p in stream]
            many = await asyncio.gather(*(client.chat(QUESTION, **GREEDY) for _ in range(4)))
            return pieces, stream.result, many

    pieces, result, many = asyncio.run(run())
    assert "".join(pieces) == result.text == reference.text
    assert [g.text for g in many] == [reference.text] * 4, "batched greedy answers differ from the single one"


def test_plain_prompt_system_prompt_stop_and_seed(server, reference):
    with GenerationClient(server.grpc_url, "grpc") as client:
        plain = client.generate("The capital of France is", **GREEDY)
        assert plain.text.strip() and plain.num_input_tokens < reference.num_input_tokens  # no template around it
        with_system = client.chat(QUESTION, system="You are a terse geography teacher.", **GREEDY)
        assert with_system.num_input_tokens != reference.num_input_tokens

        # Stop at a word inside the greedy answer: the text ends right before it.
        words = reference.text.split()
        stop = " " + words[len(words) // 2]
        cut = reference.text.index(stop)
        stopped = client.chat(QUESTION, stop=[stop], **GREEDY)
        assert (stopped.text, stopped.finish_reason) == (reference.text[:cut], "stop")

        sampled = [client.chat(QUESTION, max_tokens=12, temperature=1.0, seed=7).text for _ in range(2)]
        assert sampled[0] == sampled[1], "the same seed gave different answers"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_invalid_argument_is_one_generation_error_naming_the_field(server, protocol):
    with GenerationClient(url(server, protocol), protocol) as client:
        for call in (lambda: client.chat(QUESTION, max_tokens=0), lambda: list(client.chat_stream(QUESTION, max_tokens=0))):
            with pytest.raises(GenerationError) as info:
                call()
            assert "max_tokens" in info.value.server_message
            if protocol == "http":
                assert info.value.status == "400"
        with pytest.raises(GenerationError, match="top_p"):
            client.generate("hello", top_p=1.5)
        # The client is still usable after the errors.
        assert client.chat(QUESTION, **GREEDY).text.strip()

    async def run():
        async with AsyncGenerationClient(url(server, protocol), protocol) as client:
            await client.chat(QUESTION, temperature=-1.0)

    with pytest.raises(GenerationError, match="temperature"):
        asyncio.run(run())


def wait_idle(server, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running_requests(server) == 0:
            return timeout - (deadline - time.monotonic())
        time.sleep(0.1)
    pytest.fail(f"the engine still runs a request {timeout} s after the stream was closed")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_closing_a_long_stream_cancels_it_on_the_server(server, protocol):
    with GenerationClient(url(server, protocol), protocol) as client:
        stream = client.chat_stream(
            "Write a very long story about a lighthouse.", max_tokens=1000, ignore_eos=True, temperature=0
        )
        # Read until the engine's gauge (reported every 0.5 s) shows the stream running.
        deadline = time.monotonic() + 20
        for _piece in stream:
            if running_requests(server) >= 1 or time.monotonic() > deadline:
                break
        assert running_requests(server) >= 1
        start = time.monotonic()
        stream.close()
        # at once, not after the 1000 tokens (minutes here): a busy machine may take a few seconds
        assert time.monotonic() - start < 10.0, "closing the stream blocked"
        wait_idle(server)
        assert stream.result is None
        # The client goes on working after a cancelled stream.
        assert client.chat(QUESTION, **GREEDY).text.strip()


def test_asyncio_cancel_frees_the_engine(server):
    async def run():
        async with AsyncGenerationClient(server.grpc_url, "grpc") as client:
            async with client.chat_stream("Count from one to one thousand.", max_tokens=1000, ignore_eos=True) as stream:
                async for _ in stream:
                    if len(stream.text) > 10:
                        break

    start = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - start < 60
    wait_idle(server)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clients", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_cli_chat_streams_the_answer_and_reports_tokens(server, reference):
    done = cli("chat", QUESTION, "--max-tokens", "12", "--temperature", "0", "--url", server.grpc_url)
    assert done.returncode == 0, done.stderr
    assert done.stdout == reference.text + "\n"
    summary = done.stderr.strip().splitlines()[-1]
    assert (
        summary.startswith(f"finish_reason={reference.finish_reason} ")
        and f"output_tokens={reference.num_output_tokens}" in summary
    )
    assert "tokens/s=" in summary

    http = cli("chat", QUESTION, "--max-tokens", "12", "--temperature", "0", "--protocol", "http", "--url", server.http_url)
    assert http.returncode == 0 and http.stdout == done.stdout


def test_cli_error_exit_status_and_message(server):
    done = cli("generate", "hello", "--max-tokens", "0", "--url", server.grpc_url)
    assert done.returncode == 1 and done.stdout.strip() == ""
    assert "max_tokens" in done.stderr and done.stderr.count("\n") == 1


def test_cli_ctrl_c_cancels_the_request(server):
    import signal

    # SIGINT as a terminal delivers it: a test run started in the background of a shell script
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler at all.
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clients",
            "generate",
            "Once upon a time",
            "--max-tokens",
            "1000",
            "--ignore-eos",
            "--url",
            server.grpc_url,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        # Wait for the first pieces, then interrupt as a terminal's Ctrl-C would.
        assert process.stdout is not None
        process.stdout.read(8)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130 and "cancelled" in err
    wait_idle(server)
