"""The Batch API's parts without a server: the store's exactly-once results and leases, the
checks of an input file, and the multipart parser of uploads."""

from __future__ import annotations

import json
import time

import pytest

from openai_gateway.batch_store import BatchStore
from openai_gateway.batches import check_lines, new_batch
from openai_gateway.errors import APIError
from openai_gateway.routes.files import parse_form


def line(custom_id: str, url: str = "/v1/embeddings", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", "input": "x", **body}}


@pytest.fixture
def store(tmp_path):
    s = BatchStore(tmp_path)
    yield s
    s.close()


def test_a_result_counts_once_and_survives_a_reopen(store, tmp_path):
    batch = new_batch("batch_a", "/v1/embeddings", "file-a", "24h", None, 3, [])
    store.add_batch(batch, 3, "key")
    assert store.add_result("batch_a", 1, True, b"{}")
    assert not store.add_result("batch_a", 1, False, b"{}")  # a second answer of the line is dropped
    store.add_result("batch_a", 2, False, b"{}")
    store.close()
    again = BatchStore(tmp_path)
    assert again.done_lines("batch_a") == {1, 2}
    assert again.get_batch("batch_a")["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    again.close()


def test_one_gateway_holds_a_batch_until_its_lease_lapses(store):
    store.add_batch(new_batch("batch_b", "/v1/embeddings", "file-b", "24h", None, 1, []), 1, "key")
    assert store.take_leases("one", 0.2, 16) == ["batch_b"]
    assert store.take_leases("two", 0.2, 16) == []
    assert store.renew_lease("one", "batch_b", 0.2)
    time.sleep(0.3)
    assert store.take_leases("two", 30, 16) == ["batch_b"]
    assert not store.renew_lease("one", "batch_b", 30)  # the first learns it lost the batch
    assert store.transition("batch_b", "cancelling", ("in_progress", "validating"))
    assert not store.transition("batch_b", "cancelling", ("in_progress", "validating"))
    assert store.get_batch("batch_b")["cancelling_at"]


def test_the_lines_of_a_file_are_checked_with_their_numbers(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [line("a"), line("a"), {**line("b"), "method": "GET"}, line("c", "/v1/chat/completions"), line("d", dimensions="x")]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\nnot json\n")
    total, errors = check_lines(path, 100, "/v1/embeddings")
    assert total == 6
    assert [(e["line"], e["code"], e["param"]) for e in errors] == [
        (2, "duplicate_custom_id", "custom_id"),
        (3, "invalid_method", "method"),
        (4, "mismatched_endpoint", "url"),
        (5, "invalid_request", "body.dimensions"),
        (7, "invalid_json_line", None),
    ]
    assert check_lines(path, 3, None)[1][-1]["code"] == "too_many_tasks"


def test_parse_form_finds_the_file_and_the_purpose(tmp_path):
    body = (
        b"preamble\r\n--XyZ\r\n"
        b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XyZ\r\n'
        b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
        b'{"a": 1}\r\n{"b": 2}\r\n--XyZ--\r\n'
    )
    path = tmp_path / "body"
    path.write_bytes(body)
    fields, upload = parse_form(path, b"XyZ")
    assert fields == {"purpose": "batch"} and upload is not None
    start, end, filename = upload
    assert (body[start:end], filename) == (b'{"a": 1}\r\n{"b": 2}', "in.jsonl")
    path.write_bytes(body[:-30])
    with pytest.raises(APIError) as info:
        parse_form(path, b"XyZ")
    assert info.value.status == 400 and info.value.param == "file"


def test_a_batch_resumed_after_its_window_runs_no_line_and_expires(tmp_path):
    """A gateway that takes up a batch whose completion window has passed (it was down at the
    time) sends none of its remaining lines: they go to the error file as batch_expired."""
    import asyncio
    from types import SimpleNamespace
    from unittest import mock

    from openai_gateway.batches import BatchRunner
    from openai_gateway.settings import GatewaySettings

    app = SimpleNamespace(state=SimpleNamespace(gateway=SimpleNamespace(metrics=mock.MagicMock())))
    runner = BatchRunner(app, GatewaySettings(batch_dir=tmp_path))  # type: ignore[arg-type]
    store = runner.store()
    store.file_path("file-in").write_text("".join(json.dumps(line(c)) + "\n" for c in "abc"))
    batch = new_batch("batch_late", "/v1/embeddings", "file-in", "24h", None, 3, [])
    store.add_batch({**batch, "status": "in_progress", "expires_at": int(time.time()) - 1}, 3, "key")
    sent: list = []

    async def call(url, body, key_id):
        sent.append(body)
        return 200, {}, "req"

    runner.call = call  # type: ignore[method-assign]

    async def run():
        runner._slots = asyncio.Semaphore(4)
        await runner._drive("batch_late")

    asyncio.run(run())
    done = store.get_batch("batch_late")
    assert sent == [] and done["status"] == "expired" and done["output_file_id"] is None
    errors = store.file_path(done["error_file_id"]).read_text().splitlines()
    assert [json.loads(e)["error"]["code"] for e in errors] == ["batch_expired"] * 3
    store.close()


def test_an_expired_batchs_files_list_each_line_once_when_a_result_lands_during_finalize(tmp_path):
    """A line whose commit lands while the files are written (its request was in flight when the
    window passed) is in the output file or expired in the error file, never both."""
    import asyncio
    from types import SimpleNamespace
    from unittest import mock

    from openai_gateway.batches import BatchRunner
    from openai_gateway.settings import GatewaySettings

    app = SimpleNamespace(state=SimpleNamespace(gateway=SimpleNamespace(metrics=mock.MagicMock())))
    runner = BatchRunner(app, GatewaySettings(batch_dir=tmp_path))  # type: ignore[arg-type]
    store = runner.store()
    store.file_path("file-in").write_text("".join(json.dumps(line(c)) + "\n" for c in "abc"))
    batch = new_batch("batch_race", "/v1/embeddings", "file-in", "24h", None, 3, [])
    store.add_batch({**batch, "status": "in_progress", "expires_at": int(time.time()) - 1}, 3, "key")
    for n in (1, 2):
        store.add_result("batch_race", n, True, json.dumps({"custom_id": "abc"[n - 1]}).encode())
    late = [b'{"custom_id": "c"}']

    def after_first_read(method):
        def read(*args, **kwargs):
            out = method(*args, **kwargs)
            while late:  # the in-flight line's commit, right after the finalizer's first read
                store.add_result("batch_race", 3, True, late.pop())
            return out

        return read

    for name in ("done_lines", "records", "result_rows"):
        if hasattr(store, name):
            setattr(store, name, after_first_read(getattr(store, name)))
    asyncio.run(runner._finalize(store.get_batch("batch_race"), "expired"))
    done = store.get_batch("batch_race")
    listed = [
        json.loads(r)["custom_id"]
        for field in ("output_file_id", "error_file_id")
        if done[field]
        for r in store.file_path(done[field]).read_text().splitlines()
    ]
    assert done["status"] == "expired" and sorted(listed) == ["a", "b", "c"]
    store.close()
