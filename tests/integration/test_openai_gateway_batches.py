"""OpenAI's Files and Batch APIs on the gateway (``/v1/files``, ``/v1/batches``), through the
official openai SDK, in front of the session's tritonserver:

1. an embeddings batch and a chat batch whose outputs equal the same requests sent directly;
2. limits and malformed files: 400 naming the field (and the line); a bad line fails the batch
   with OpenAI's ``errors.data``;
3. cancel;
4. a gateway killed (SIGKILL) mid-batch and restarted on the same store: the lines committed
   before the kill ran once, those in flight ran again exactly once, every custom_id is in the
   output once.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid

import numpy as np
import openai
import pytest

from tests.integration.conftest import GATEWAY_TEST_KEY
from tests.metrics_text import metric_sum, scrape

EMB = "text_embedding"
GEN = "text_generation"
CONCURRENCY = 2
GATEWAY_ARGS = (
    "--rate-limit",
    "0",
    "--batch-max-file-mb",
    "0.05",
    "--batch-max-lines",
    "60",
    "--batch-concurrency",
    str(CONCURRENCY),
    "--batch-lease-s",
    "2",
)


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("batches")


@pytest.fixture(scope="module")
def batch_gateway(triton, start_gateway, batch_dir):
    with start_gateway(triton.triton_grpc_url, *GATEWAY_ARGS, "--batch-dir", str(batch_dir)) as gw:
        yield gw


def sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=GATEWAY_TEST_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(batch_gateway):
    with sdk(batch_gateway) as c:
        yield c


def jsonl(lines: list[dict]) -> bytes:
    return "\n".join(json.dumps(line) for line in lines).encode()


def embedding_lines(n: int, prefix: str = "doc") -> list[dict]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": EMB, "input": [f"{prefix} number {i} about batches", f"second text {i}"]},
        }
        for i in range(n)
    ]


def upload(client: openai.OpenAI, lines: list[dict]) -> str:
    return client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch").id


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


# --- 1. outputs equal direct requests ---------------------------------------------------------


def test_an_embeddings_batch_equals_the_same_requests_sent_directly(client, batch_gateway):
    lines = embedding_lines(5)
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/embeddings", completion_window="24h", metadata={"job": "emb"}
    )
    assert batch.status == "validating" and batch.request_counts.total == 5 and batch.metadata == {"job": "emb"}
    done = wait_for(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    out = records(client, done.output_file_id)
    assert [r["custom_id"] for r in out] == [line["custom_id"] for line in lines]
    for line, record in zip(lines, out, strict=True):
        assert record["response"]["status_code"] == 200 and record["error"] is None and record["id"].startswith("batch_req_")
        direct = client.embeddings.create(**line["body"])
        got = np.array([d["embedding"] for d in record["response"]["body"]["data"]])
        want = np.array([d.embedding for d in direct.data])
        assert np.abs(got - want).max() < 1e-5
        assert record["response"]["body"]["usage"]["prompt_tokens"] == direct.usage.prompt_tokens
    text = scrape(f"{batch_gateway.url}/metrics")
    assert metric_sum(text, "gateway_batch_lines_total", endpoint="/v1/embeddings", outcome="completed") >= 5


def test_a_chat_batch_equals_the_same_requests_sent_directly(client):
    bodies = [
        {"model": GEN, "messages": [{"role": "user", "content": q}], "max_tokens": 6, "temperature": 0}
        for q in ("What is the capital of France?", "Name a colour.")
    ]
    lines = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": b} for i, b in enumerate(bodies)]
    # A model that is not served fails its line (404 in the error file), not the batch.
    lines.append({**lines[0], "custom_id": "chat-missing", "body": {**bodies[0], "model": "no-such-model"}})
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, batch.id, ("completed", "failed"), timeout=120)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 2, 1), done
    out = {r["custom_id"]: r for r in records(client, done.output_file_id)}
    errors = records(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["chat-missing"] and errors[0]["response"]["status_code"] == 404
    for i, body in enumerate(bodies):
        direct = client.chat.completions.create(**body)
        answer = out[f"chat-{i}"]["response"]["body"]
        assert answer["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert answer["usage"]["completion_tokens"] == direct.usage.completion_tokens


# --- 2. limits and malformed files --------------------------------------------------------------


def refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value


def test_uploads_over_the_limits_or_not_jsonl_are_400_naming_the_field_and_line(client):
    err = refused(lambda: client.files.create(file=("big.jsonl", b"{}\n" * 20000), purpose="batch"))
    assert err.param == "file" and "limit is 52428" in err.message
    err = refused(lambda: client.files.create(file=("many.jsonl", jsonl(embedding_lines(61))), purpose="batch"))
    assert err.param == "file" and err.code == "too_many_tasks" and "60" in err.message
    err = refused(lambda: client.files.create(file=("bad.jsonl", jsonl(embedding_lines(2)) + b"\nnot json"), purpose="batch"))
    assert err.param == "file" and err.code == "invalid_json_line" and "line 3" in err.message
    err = refused(lambda: client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune"))
    assert err.param == "purpose"


def test_a_bad_line_fails_the_batch_with_its_line_and_field(client):
    lines = embedding_lines(3)
    lines[1]["custom_id"] = lines[0]["custom_id"]
    lines[2]["body"] = {"model": EMB, "input": "x", "stream": True, "encoding_format": "octal"}
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/embeddings", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None and batch.errors.data is not None
    found = [(e.line, e.code, e.param) for e in batch.errors.data]
    assert found == [(2, "duplicate_custom_id", "custom_id"), (3, "invalid_request", "body.encoding_format")], found
    err = refused(
        lambda: client.batches.create(
            input_file_id=upload(client, lines[:1]), endpoint="/v1/chat/completions", completion_window="1h"
        )
    )
    assert err.param == "completion_window"
    batch = client.batches.create(
        input_file_id=upload(client, lines[:1]), endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed" and batch.errors.data[0].param == "url"


# --- 3. cancel ------------------------------------------------------------------------------


def test_cancel(client, batch_dir):
    lines = embedding_lines(40, "cancel")
    input_id = upload(client, lines)
    batch = client.batches.create(input_file_id=input_id, endpoint="/v1/embeddings", completion_window="24h")
    err = refused(lambda: client.files.delete(input_id))  # the input of an unfinished batch is kept
    assert err.param == "file_id" and batch.id in err.message
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_for(client, batch.id, ("cancelled",))
    assert client.files.delete(input_id).deleted
    assert not list((batch_dir / "files").glob("*.tmp"))  # each finaliser's own files, moved in place
    assert done.cancelling_at and done.cancelled_at
    assert done.request_counts.completed < 40
    ids = [r["custom_id"] for r in records(client, done.output_file_id)]
    assert len(ids) == len(set(ids)) == done.request_counts.completed
    small = client.batches.create(input_file_id=upload(client, lines[:1]), endpoint="/v1/embeddings", completion_window="24h")
    err = refused(lambda: client.batches.cancel(wait_for(client, small.id, ("completed",)).id))
    assert err.param == "batch_id" and "completed" in err.message


# --- 4. killed mid-batch, resumed on the same store -------------------------------------------------


def test_a_gateway_killed_mid_batch_resumes_without_repeating_or_losing_a_line(triton, start_gateway, tmp_path):
    n = 60
    lines = embedding_lines(n, f"kill-{uuid.uuid4().hex[:8]}")  # new texts: none answered by the cache
    store = tmp_path / "store.sqlite3"

    def committed(batch_id: str) -> set[int]:
        with sqlite3.connect(store) as db:
            return {r[0] for r in db.execute("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}

    args = (*GATEWAY_ARGS, "--batch-dir", str(tmp_path))
    with start_gateway(triton.triton_grpc_url, *args) as first, sdk(first) as c:
        batch = c.batches.create(input_file_id=upload(c, lines), endpoint="/v1/embeddings", completion_window="24h")
        deadline = time.monotonic() + 60
        while c.batches.retrieve(batch.id).request_counts.completed < 5:
            assert time.monotonic() < deadline, first.log_tail()
            time.sleep(0.02)
        assert first.process is not None
        first.process.kill()
        first.process.wait()
        before = committed(batch.id)
    assert 5 <= len(before) < n, f"the batch finished before the kill ({len(before)} lines)"
    with start_gateway(triton.triton_grpc_url, *args) as second, sdk(second) as c:
        done = wait_for(c, batch.id, ("completed", "failed"))
        out = records(c, done.output_file_id)
        resumed = metric_sum(scrape(f"{second.url}/metrics"), "gateway_batch_lines_total")
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", n, 0)
    assert sorted(r["custom_id"] for r in out) == sorted(line["custom_id"] for line in lines)
    assert resumed == n - len(before)  # the restarted gateway committed only the lines not done
    with sqlite3.connect(store) as db:
        attempts = dict(db.execute("SELECT line, n FROM attempts WHERE batch_id = ?", (batch.id,)).fetchall())
    assert sorted(attempts) == list(range(1, n + 1))
    again = {line for line, runs in attempts.items() if runs > 1}
    assert all(attempts[line] == 1 for line in before), "a line committed before the kill ran again"
    assert all(attempts[line] == 2 for line in again) and len(again) <= CONCURRENCY, attempts
    print(
        f"killed after {len(before)} of {n} lines committed; {len(again)} in flight ran again; executions {sum(attempts.values())}"
    )
