"""Triton's HTTP generate_stream through the gRPC door's stream listener (server/stream_door.py),
without Triton: a fake upstream writes server-sent events as tritonserver does and dies (its
connection cut, or silent with the model marked by the watchdog) partway; the client reads every
piece once and no error, or, where a stream cannot go on, an error event at once (never a hang)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from contract.errors import MARK, UNAVAILABLE, InputError, data_from_body, format_error
from server.frontdoor import model_limits
from server.grpc_check import Limits
from server.grpc_door import Door
from server.stream_door import STREAM_DOOR, Continuation, start

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
LIMITS = Limits(models=model_limits(REPOSITORY), max_elements=1 << 26)
PIECES = [("The", 10), (" cap", 11), ("ital", 12), (" is", 13), (" Paris", 14), (".", 15)]
TEXT = "The capital is Paris."


def event(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


# --------------------------------------------------------------------------- the continuation alone


def test_a_continuation_asks_for_ids_keeps_them_and_sends_them_back_as_prefix():
    plan = Continuation.of({"text_input": "Hi", "max_tokens": 8})
    assert plan is not None and not plan.client_wants_ids
    assert orjson.loads(plan.request_body()) == {
        "text_input": "Hi",
        "max_tokens": 8,
        # request parameters, which the model reads as its inputs; an event has no final flag:
        # the reason says the answer ended
        "parameters": {"return_token_ids": True, "return_finish_reason": True},
    }
    out, error = plan.incoming(event({"text_output": "The", "token_ids": 10}))
    assert error is None and orjson.loads(out[6:]) == {"text_output": "The"}  # taken out: not asked
    plan.incoming(event({"text_output": " cap", "token_ids": [11]}))
    assert plan.can_resume() and plan.ids == [10, 11]
    assert orjson.loads(plan.request_body())["prefix_token_ids"] == [10, 11]


def test_a_client_that_asked_keeps_its_ids_and_its_own_prefix_comes_first():
    plan = Continuation.of({"text_input": "Hi", "return_token_ids": True, "prefix_token_ids": [7, 8]})
    assert plan is not None and plan.client_wants_ids
    raw = event({"text_output": "x", "token_ids": [9]})
    assert plan.incoming(raw) == (raw, None)
    assert orjson.loads(plan.request_body())["prefix_token_ids"] == [7, 8, 9]


def test_a_flag_the_client_gave_as_a_parameter_or_an_input_is_not_given_twice():
    """tritonserver refuses a name that is both an input and a parameter ("input ... already exists")."""
    plan = Continuation.of({"text_input": "Hi", "parameters": {"return_finish_reason": True, "max_tokens": 4}})
    assert plan is not None and plan.client_wants_reason and not plan.client_wants_ids
    sent = orjson.loads(plan.request_body())
    assert "return_finish_reason" not in sent and sent["parameters"]["return_finish_reason"] is True
    plan = Continuation.of({"text_input": "Hi", "return_token_ids": True})
    sent = orjson.loads(plan.request_body())
    assert sent["return_token_ids"] is True and "return_token_ids" not in sent["parameters"]
    assert Continuation.of({"text_input": "Hi", "parameters": {"return_token_ids": False}}) is None
    assert Continuation.of({"text_input": "Hi", "parameters": "x"}) is None


def test_what_cannot_be_continued_says_so():
    assert Continuation.of({"text_input": "Hi", "return_token_ids": False}) is None
    assert Continuation.of({"text_input": "Hi", "prefix_token_ids": ["a"]}) is None
    assert Continuation.of([1, 2]) is None
    plan = Continuation.of({"text_input": "Hi"})
    assert not plan.can_resume()  # nothing answered yet: a loss ends it (its client retries)
    plan.incoming(event({"text_output": "a", "index": 1, "token_ids": [1]}))  # n > 1
    assert not plan.can_resume()
    other = Continuation.of({"text_input": "Hi"})
    assert other.incoming(event({"error": "boom"})) == (event({"error": "boom"}), "boom")


# --------------------------------------------------------------------------- the door, over a fake upstream


class FakeTriton:
    """generate_stream as tritonserver writes it. The first call dies after ``cut`` events: its
    connection cut (``how="cut"``), or it goes silent while the test marks the model (``"silent"``).
    Later calls continue after the prefix they are given."""

    def __init__(
        self,
        cut: int,
        how: str = "cut",
        health_dir: Path | None = None,
        first_after_s: float = 0.0,
        pad: int = 0,
        error: str | None = None,
    ):
        self.cut, self.how, self.health_dir = cut, how, health_dir
        self.error = error  # a model's error message: the event after ``cut`` pieces ("refuse": before the stream)
        self.first_after_s, self.pad = first_after_s, pad
        self.bodies: list[dict] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        first = len(self.bodies) == 1
        if self.error is not None and self.how == "refuse":
            return web.json_response({"error": self.error}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        def asked(flag: str) -> bool:  # an input (top level) or a request parameter, as tritonserver takes either
            return bool(body.get(flag) or body.get("parameters", {}).get(flag))

        start = len(body.get("prefix_token_ids", []))
        await asyncio.sleep(self.first_after_s)  # a long queue or prefill before the first token
        for i, (text, token) in enumerate(PIECES[start:], start):
            if first and i == self.cut:
                if self.error is not None:
                    await response.write(event({"error": self.error}))
                    await response.write_eof()
                    return response
                if self.how == "cut":
                    request.transport.close()  # a replica killed mid-answer
                    return response
                (self.health_dir / request.match_info["model"]).write_text("stub died (pid 1, SIGKILL)")
                await asyncio.sleep(60)  # a dead stub: nothing more, and nothing says so
            piece = {"model_name": request.match_info["model"], "model_version": "1", "text_output": text + " " * self.pad}
            if asked("return_token_ids"):
                piece["token_ids"] = token
            if asked("return_finish_reason"):
                piece["finish_reason"] = "length" if i == len(PIECES) - 1 else None
            await response.write(event(piece))
            await asyncio.sleep(0.01)
        if first and self.how == "cut after the last":
            request.transport.close()  # every piece sent, the stream's end not
            return response
        await response.write_eof()
        return response


def _through_the_door(
    tmp_path: Path, fake: FakeTriton, body: dict, model: str = "text_generation", healing_dirs: tuple[Path, ...] = ()
):
    async def go():
        app = web.Application()
        app.router.add_post("/v2/models/{model}/generate_stream", fake.handle)
        upstream = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
        await upstream.setup()
        site = web.TCPSite(upstream, "127.0.0.1", 0)
        await site.start()
        up_port = site._server.sockets[0].getsockname()[1]
        door = Door("127.0.0.1:1", LIMITS, fake.health_dir, 1 << 26, healing_dirs=healing_dirs)
        runner = await start(door, "127.0.0.1:0", f"127.0.0.1:{up_port}", 1 << 26)
        port = runner.addresses[0][1]
        stream_door = runner.app[STREAM_DOOR]
        try:
            async with aiohttp.ClientSession() as client:
                url = f"http://127.0.0.1:{port}/v2/models/{model}/generate_stream"
                async with client.post(url, json=body) as r:
                    status, raw = r.status, await asyncio.wait_for(r.read(), 20)
        finally:
            await runner.cleanup()
            await upstream.cleanup()
            await door.channel.close()
        events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
        return status, raw, events, stream_door

    return asyncio.run(go())


def test_a_stream_cut_mid_answer_goes_on_with_every_piece_once(tmp_path):
    fake = FakeTriton(cut=3)
    status, _, events, door = _through_the_door(tmp_path, fake, {"text_input": "Hi", "max_tokens": 6})
    assert status == 200 and "".join(e["text_output"] for e in events) == TEXT
    assert all("token_ids" not in e and "error" not in e for e in events)  # ids taken out again
    first, second = fake.bodies
    assert first["parameters"]["return_token_ids"] is True and "prefix_token_ids" not in first
    assert second["prefix_token_ids"] == [10, 11, 12] and second["max_tokens"] == 6
    assert door.streams_resumed == 1


def test_a_stream_whose_stub_died_goes_on_once_the_watchdog_marks_it(tmp_path):
    health = tmp_path / "health"
    health.mkdir()
    fake = FakeTriton(cut=2, how="silent", health_dir=health)
    status, _, events, door = _through_the_door(tmp_path, fake, {"text_input": "Hi", "return_token_ids": True})
    assert status == 200 and "".join(e["text_output"] for e in events) == TEXT
    assert [e["token_ids"] for e in events] == [t for _, t in PIECES]  # asked for: kept
    assert fake.bodies[1]["prefix_token_ids"] == [10, 11] and door.streams_resumed == 1


def test_a_stream_that_cannot_go_on_ends_at_once_with_an_error_event(tmp_path):
    health = tmp_path / "health"
    health.mkdir()
    fake = FakeTriton(cut=2, how="silent", health_dir=health)
    # not a continuable model: before, such a stream stayed open until the client's timeout
    status, _, events, door = _through_the_door(tmp_path, fake, {"text_input": "Hi"}, model="other_decoupled")
    assert status == 200 and [e.get("text_output") for e in events[:2]] == ["The", " cap"]
    assert "error" in events[-1] and "other_decoupled" in events[-1]["error"] and "stub died" in events[-1]["error"]
    data = data_from_body(events[-1])  # retry: the data says so, as the event's own keys
    assert data is not None and data.code == UNAVAILABLE and data.http_status == 503
    assert MARK not in events[-1]["error"] and data.message == events[-1]["error"]
    assert len(fake.bodies) == 1 and door.streams_ended == 1


def test_a_stream_cut_after_its_last_event_is_whole_and_not_sent_again(tmp_path):
    """HTTP events have no final flag: the finish_reason the door asks for says the answer ended."""
    fake = FakeTriton(cut=99, how="cut after the last")
    status, _, events, door = _through_the_door(tmp_path, fake, {"text_input": "Hi"})
    assert status == 200 and "".join(e["text_output"] for e in events) == TEXT
    assert all("finish_reason" not in e and "error" not in e for e in events)  # not asked: taken out
    assert len(fake.bodies) == 1 and door.streams_resumed == 0


def test_a_mark_on_another_replica_does_not_cut_a_healthy_stream_before_its_first_token(tmp_path):
    """serve-cluster: a model marked in some replica's folder; this stream's replica is healthy and
    slow to its first token (a queue): it is not cut, as it could not be continued anyway."""
    other = tmp_path / "replica-1-health"
    other.mkdir()
    (other / "text_generation").write_text("stub died on the other replica")
    fake = FakeTriton(cut=99, first_after_s=1.6)
    status, _, events, door = _through_the_door(tmp_path, fake, {"text_input": "Hi"}, healing_dirs=(other,))
    assert status == 200 and "".join(e["text_output"] for e in events) == TEXT
    assert len(fake.bodies) == 1 and door.streams_resumed == door.streams_ended == 0


def test_an_event_larger_than_aiohttps_read_buffer_passes_whole(tmp_path):
    fake = FakeTriton(cut=99, pad=600_000)  # each event about 600 KB (aiohttp's default line limit is 512 KiB)
    status, _, events, _ = _through_the_door(tmp_path, fake, {"text_input": "Hi"}, model="other_decoupled")
    assert status == 200 and "".join(e["text_output"].rstrip(" ") for e in events) == TEXT


def test_a_stream_lost_before_its_first_event_answers_503_and_is_not_sent_around(tmp_path):
    fake = FakeTriton(cut=0)
    status, raw, events, door = _through_the_door(tmp_path, fake, {"text_input": "Hi"})
    assert status == 503 and b"text_generation" in raw and len(fake.bodies) == 1 and door.streams_resumed == 0
    body = json.loads(raw)
    assert data_from_body(body).code == UNAVAILABLE and MARK not in body["error"], body


MODEL_ERROR = format_error(InputError("max_tokens", "must be <= 2048, got 5000", values={"limit": 2048, "got": 5000}))


@pytest.mark.parametrize("how", ["event", "refuse"])
def test_a_models_error_reaches_the_client_with_its_data_as_the_bodys_keys(tmp_path, how):
    """tritonserver passes the model's words with the data after them; this public edge moves the
    data into the event's (or the refusal's) own keys and leaves the words alone."""
    fake = FakeTriton(cut=2, how=how, error=MODEL_ERROR)
    status, raw, events, door = _through_the_door(tmp_path, fake, {"text_input": "Hi"}, model="other_decoupled")
    error = events[-1] if how == "event" else json.loads(raw)
    assert status == (200 if how == "event" else 400), raw
    assert error["error"] == "max_tokens: must be <= 2048, got 5000" and MARK.strip() not in raw.decode(), raw
    assert (error["code"], error["field"], error["values"]) == ("invalid_value", "max_tokens", {"limit": 2048, "got": 5000})
    assert door.streams_resumed == 0 and len(fake.bodies) == 1


@pytest.mark.parametrize("option", ["--stream-door", "--stream-upstream-listen"])
def test_render_takes_the_stream_door_and_its_listener_together(tmp_path, option):
    from server import frontdoor

    out = tmp_path / "out"
    args = ["render", "--out", str(out), "--stream-door", "grpc-door:8005", "--stream-upstream-listen", "0.0.0.0:8006"]
    assert frontdoor.main(args) == 0
    conf = (out / "nginx.conf").read_text()
    assert "proxy_pass http://grpc-door:8005;" in conf and "listen 0.0.0.0:8006;" in conf
    lone = [a for a in args if a not in (option, {"--stream-door": "grpc-door:8005"}.get(option, "0.0.0.0:8006"))]
    with pytest.raises(SystemExit):
        frontdoor.main(lone)
    assert frontdoor.main(["render", "--out", str(out)]) == 0
    conf = (out / "nginx.conf").read_text()
    stream_block = conf.split("location @triton_stream {", 1)[1].split("}", 1)[0]
    assert "BEGIN stream_door" not in conf and "proxy_pass http://triton_http;" in stream_block
