"""The text_generation clients without a tritonserver: SSE parsing (events split anywhere,
multi-byte UTF-8 across chunks), request building for both protocols, responses as pieces,
error mapping, the CLI's options and output, and the HTTP stream path against a local SSE
server that checks a closed stream drops the connection."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from clients.generation import (
    SAMPLING_FIELDS,
    AsyncGenerationClient,
    GenerateRequest,
    Generation,
    GenerationClient,
    GenerationError,
    GenerationOptions,
    Piece,
    SSEDecoder,
    Tracker,
    chat_messages,
    cli,
    http_error,
    is_final,
    piece_from_json,
    piece_from_result,
    sampling_parameters,
)
from server.process import free_port

# Two-, three- and four-byte UTF-8 characters, so that splits land inside each of them.
TEXTS = ["Grüße ", "aus ", "日本", " 🙂", "\n", "end"]


def sse_bytes(pieces, line_end=b"\n") -> bytes:
    out = b""
    for i, text in enumerate(pieces):
        event = {"text_output": text, "finish_reason": "length" if i == len(pieces) - 1 else "", "num_output_tokens": i + 1}
        out += b"data: " + json.dumps(event, ensure_ascii=False).encode("utf-8") + line_end + line_end
    return out


# --- SSE -----------------------------------------------------------------------------------


@pytest.mark.parametrize("line_end", [b"\n", b"\r\n", b"\r"])
def test_sse_every_split_point_gives_the_same_events(line_end):
    data = sse_bytes(TEXTS, line_end)
    decoder = SSEDecoder()
    # A CR at the very end may be half of a CRLF: that last event completes at close().
    whole = [json.loads(e)["text_output"] for e in decoder.feed(data) + decoder.close()]
    assert whole == TEXTS
    for cut in range(1, len(data)):
        decoder = SSEDecoder()
        events = decoder.feed(data[:cut]) + decoder.feed(data[cut:]) + decoder.close()
        assert [json.loads(e)["text_output"] for e in events] == TEXTS, f"split at byte {cut}"


def test_sse_byte_by_byte_never_yields_a_broken_character():
    decoder = SSEDecoder()
    events = []
    for b in sse_bytes(TEXTS):
        events += decoder.feed(bytes([b]))
    assert "".join(json.loads(e)["text_output"] for e in events) == "".join(TEXTS)
    assert "\ufffd" not in "".join(events)


def test_sse_multiline_data_comments_other_fields_and_a_last_event_without_blank_line():
    decoder = SSEDecoder()
    events = decoder.feed(b": keep-alive\nevent: message\nid: 3\ndata: first\ndata:second\n\nretry: 5\n\n\n")
    assert events == ["first\nsecond"]
    assert decoder.feed(b'data: {"text_output": "x"}') == []
    assert decoder.close() == ['{"text_output": "x"}']
    assert decoder.close() == []


# --- responses -----------------------------------------------------------------------------


def test_piece_from_json_scalars_lists_and_empty_reasons():
    assert piece_from_json('{"text_output": "a", "finish_reason": "", "num_input_tokens": 3, "num_output_tokens": 1}') == Piece(
        "a", None, 3, 1
    )
    assert piece_from_json({"text_output": ["b"], "finish_reason": ["stop"], "num_output_tokens": [2]}) == Piece(
        "b", "stop", None, 2
    )
    assert piece_from_json({"text_output": "", "finish_reason": "None"}).finish_reason is None
    assert piece_from_json({"text_output": "c", "num_cached_tokens": [32]}).num_cached_tokens == 32


def test_piece_from_json_error_event_and_malformed_data():
    with pytest.raises(GenerationError) as info:
        piece_from_json('{"error": "max_tokens must be >= 1, got 0"}', status="400")
    assert info.value.server_message == "max_tokens must be >= 1, got 0" and info.value.status == "400"
    assert "max_tokens" in str(info.value)
    for bad in ("not json", "[1, 2]"):
        with pytest.raises(GenerationError, match="malformed response"):
            piece_from_json(bad)


def test_an_error_bodys_data_keys_are_read_and_the_words_stay_words():
    """The front door's and the stream door's bodies carry the data as keys; a body straight from
    tritonserver (no door) still has it after the words."""
    from contract.errors import format_error, parse_error
    from python_backends.generation.scheduler import ContextTooLong

    public = {"error": "max_tokens: 4102 exceeds 4096", "code": "context_length_exceeded", "field": "max_tokens"}
    public["values"] = {"prompt_tokens": 4086, "max_tokens": 16, "limit": 4096}
    with pytest.raises(GenerationError) as info:
        piece_from_json(json.dumps(public), status="400")
    for err in (info.value, http_error(400, "data: " + json.dumps(public) + "\n\n")):
        assert (err.code, err.field, err.values["limit"]) == ("context_length_exceeded", "max_tokens", 4096)
        assert err.server_message == public["error"]
    inside = format_error(ContextTooLong(4086, 16, 4096))
    err = http_error(400, json.dumps({"error": inside}))
    assert (err.code, err.field) == ("context_length_exceeded", "max_tokens") and err.server_message == parse_error(
        inside
    ).message


def grpc_result(text: bytes | None, reason: bytes | None = None, n_out: int | None = None, final: bool = False) -> InferResult:
    """A real ModelInferResponse, as tritonclient hands it to the stream callback."""
    response = service_pb2.ModelInferResponse(model_name="text_generation")
    for name, array, datatype in (
        ("text_output", None if text is None else np.array([text], dtype=object), "BYTES"),
        ("finish_reason", None if reason is None else np.array([reason], dtype=object), "BYTES"),
        ("num_output_tokens", None if n_out is None else np.array([n_out], dtype=np.int32), "INT32"),
    ):
        if array is None:
            continue
        response.outputs.add(name=name, datatype=datatype, shape=[1])
        response.raw_output_contents.append(serialize_byte_tensor(array).item() if datatype == "BYTES" else array.tobytes())
    if final:
        response.parameters["triton_final_response"].bool_param = True
    return InferResult(response)


def test_piece_from_grpc_result_and_the_final_flag():
    first = grpc_result("Grüße".encode(), b"", 1)
    assert piece_from_result(first) == Piece("Grüße", None, None, 1) and not is_final(first)
    last = grpc_result(b"!", b"length", 2, final=True)
    assert piece_from_result(last) == Piece("!", "length", None, 2) and is_final(last)
    empty_final = grpc_result(None, final=True)  # enable_empty_final_response: flag, no outputs
    assert piece_from_result(empty_final) == Piece("") and is_final(empty_final)


def test_tracker_times_the_first_text_and_keeps_the_latest_counts():
    now = iter([10.0, 10.5, 11.0, 12.0])
    tracker = Tracker(clock=lambda: next(now))
    assert tracker.add(Piece("", None, 7, None)) == ""  # counts before any text: no first token yet
    tracker.add(Piece("Hel", None, 7, 1))  # 10.5: first text
    tracker.add(Piece("lo", "stop", 7, 2))  # no clock read: only the first piece is timed
    g = tracker.result()  # 11.0
    assert g == Generation("Hello", "stop", 7, 2, 0.5, 1.0)
    assert g.tokens_per_s == pytest.approx(2.0)
    assert Generation("", None, None, None, None, 1.0).tokens_per_s is None


def test_http_error_bodies():
    e = http_error(400, '{"error": "temperature must be >= 0, got -1"}')
    assert (e.server_message, e.status) == ("temperature must be >= 0, got -1", "400")
    e = http_error(400, 'data: {"error":"top_p must be in (0, 1], got 2"}\n\n')
    assert e.server_message == "top_p must be in (0, 1], got 2"
    e = http_error(502, "<html>Bad Gateway</html>")
    assert e.server_message == "<html>Bad Gateway</html>" and e.status == "502"
    assert http_error(503, "").server_message == "HTTP 503"


# --- requests ------------------------------------------------------------------------------


def test_sampling_parameters_names_types_and_stop():
    assert sampling_parameters(max_tokens=8, temperature=0, top_p=None, stop="\n\n") == {
        "max_tokens": 8,
        "temperature": 0,
        "stop": ["\n\n"],
    }
    assert sampling_parameters(temperature=0.7, ignore_eos=True, stop=("a", "b")) == {
        "temperature": 0.7,
        "ignore_eos": True,
        "stop": ["a", "b"],
    }
    with pytest.raises(ValueError, match="unknown sampling parameter 'max_new_tokens'"):
        sampling_parameters(max_new_tokens=8)
    with pytest.raises(TypeError, match="max_tokens must be int"):
        sampling_parameters(max_tokens=8.0)
    with pytest.raises(TypeError, match="max_tokens must be int"):
        sampling_parameters(max_tokens=True)  # a bool is an int to Python, not to the server
    with pytest.raises(TypeError, match="ignore_eos must be bool"):
        sampling_parameters(ignore_eos=1)
    with pytest.raises(TypeError, match="stop must be"):
        sampling_parameters(stop=["a", 1])
    assert sampling_parameters(stop_token_ids=(2, 7)) == {"stop_token_ids": [2, 7]}
    with pytest.raises(TypeError, match="stop_token_ids must be a list of int"):
        sampling_parameters(stop_token_ids=["2"])
    # Ranges are the server's: its INVALID_ARG names the field.
    assert sampling_parameters(max_tokens=0, top_p=2.0) == {"max_tokens": 0, "top_p": 2.0}
    assert set(SAMPLING_FIELDS) == {
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "seed",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "ignore_eos",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "logit_bias",
        "logprobs",
        "prompt_logprobs",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "fit_to_context",
        "fit_structure_to_max_tokens",
        "priority_class",
    }
    assert sampling_parameters(logit_bias={"5": -100}, logprobs=2) == {"logit_bias": {"5": -100}, "logprobs": 2}
    assert sampling_parameters(n=1) == {"n": 1}
    with pytest.raises(ValueError, match="one choice per request"):
        sampling_parameters(n=2)
    with pytest.raises(TypeError, match="logit_bias must be dict"):
        sampling_parameters(logit_bias=[5])
    # The engine's own table: one list of fields for the clients, the gateway and the engine.
    from contract.sampling import FIELD_NAMES

    assert tuple(SAMPLING_FIELDS) == FIELD_NAMES


def test_chat_messages_and_the_system_option():
    assert chat_messages("hi") == [{"role": "user", "content": "hi"}]
    assert chat_messages("hi", system="brief") == [{"role": "system", "content": "brief"}, {"role": "user", "content": "hi"}]
    history = [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert chat_messages(history, system="new")[0] == {"role": "system", "content": "new"}
    assert len(chat_messages(history, system="new")) == 3
    with pytest.raises(ValueError, match="role must be one of"):
        chat_messages([{"role": "bot", "content": "x"}])
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        chat_messages([{"role": "user"}])
    with pytest.raises(ValueError, match="no messages"):
        chat_messages([])


def test_http_body_sends_sampling_as_one_json_input():
    body = json.loads(GenerateRequest.prompt("Grüße", max_tokens=8, stop=["\n"]).http_body(stream=True))
    assert body["text_input"] == "Grüße" and body["stream"] is True
    assert json.loads(body["sampling_parameters"]) == {"max_tokens": 8, "stop": ["\n"]}
    assert body["exclude_input_in_output"] and body["return_finish_reason"] and body["return_num_output_tokens"]
    assert "apply_chat_template" not in body and "parameters" not in body
    chat = json.loads(GenerateRequest.from_chat("hi", system="brief").http_body(stream=False))
    assert chat["apply_chat_template"] is True and chat["stream"] is False and "sampling_parameters" not in chat
    assert json.loads(chat["text_input"]) == [{"role": "system", "content": "brief"}, {"role": "user", "content": "hi"}]


def test_grpc_inputs_names_types_shapes_and_values():
    inputs = {i.name(): i for i in GenerateRequest.from_chat("日本", temperature=0).grpc_inputs(stream=True)}
    assert set(inputs) == {
        "text_input",
        "sampling_parameters",
        "stream",
        "exclude_input_in_output",
        "return_finish_reason",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "return_num_cached_tokens",
        "apply_chat_template",
    }
    assert all(i.shape() == [1] for i in inputs.values())
    assert inputs["text_input"].datatype() == "BYTES" and inputs["stream"].datatype() == "BOOL"
    text = deserialize_bytes_tensor(inputs["text_input"]._get_content())[0].decode("utf-8")
    assert json.loads(text) == [{"role": "user", "content": "日本"}]
    assert json.loads(deserialize_bytes_tensor(inputs["sampling_parameters"]._get_content())[0]) == {"temperature": 0}
    assert np.frombuffer(inputs["stream"]._get_content(), dtype=bool).tolist() == [True]


def test_options_urls_and_paths():
    assert GenerationOptions.create().url == "127.0.0.1:8001"
    assert GenerationOptions.create(protocol="http").url == "127.0.0.1:8000"
    o = GenerationOptions.create("http://example:9000/", "http", model_version="2")
    assert o.url == "example:9000" and o.host_port() == ("example", 9000)
    assert o.http_path(stream=True) == "/v2/models/text_generation/versions/2/generate_stream"
    assert GenerationOptions.create(protocol="http").http_path(False) == "/v2/models/text_generation/generate"
    for bad in (dict(protocol="ws"), dict(url="https://x:1"), dict(timeout_s=0), dict(model="")):
        with pytest.raises(ValueError):
            GenerationOptions.create(**bad)


# --- a local SSE server: chunks split inside characters, and the disconnect of a closed stream


class SSEServer:
    """Answers /generate_stream with TEXTS split into 3-byte chunks, then (``endless``) keeps
    sending until the client goes away; records that it saw the disconnect."""

    def __init__(self, endless: bool = False, status: int = 200):
        self.disconnected = threading.Event()
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                if status != 200:
                    body = b'{"error":"max_tokens must be >= 1, got 0"}'
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                data = sse_bytes(TEXTS)
                try:
                    for i in range(0, len(data), 3):
                        self._chunk(data[i : i + 3])
                    while endless:
                        self._chunk(sse_bytes(["x"])[:-2] + b"\n\n")
                        time.sleep(0.01)
                    self._chunk(b"")
                except (BrokenPipeError, ConnectionResetError):
                    outer.disconnected.set()

            def _chunk(self, payload: bytes):
                self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_http_stream_reassembles_characters_split_across_chunks():
    with SSEServer() as server, GenerationClient(server.url, "http") as client:
        stream = client.stream("hi", max_tokens=6)
        assert list(stream) == TEXTS
    assert stream.result is not None and stream.result.text == "".join(TEXTS)
    assert stream.result.finish_reason == "length" and stream.result.num_output_tokens == len(TEXTS)
    assert json.loads(server.bodies[0]["sampling_parameters"]) == {"max_tokens": 6}


def test_http_stream_closed_early_drops_the_connection():
    with SSEServer(endless=True) as server, GenerationClient(server.url, "http") as client:
        with client.stream("hi") as stream:
            assert next(stream) == TEXTS[0]
        assert server.disconnected.wait(5), "the server never saw the client go away"
        assert stream.result is None and list(stream) == []


def test_async_http_stream_and_cancel():
    async def run(server):
        async with AsyncGenerationClient(server.url, "http") as client:
            stream = client.stream("hi")
            got = [p async for p in stream]
            async with client.chat_stream("hi") as early:
                async for _ in early:
                    break
            return got, stream.result

    with SSEServer() as server:
        got, result = asyncio.run(run(server))
    assert got == TEXTS and result.text == "".join(TEXTS)
    with SSEServer(endless=True) as server:
        asyncio.run(run_cancel(server))
        assert server.disconnected.wait(5)


async def run_cancel(server):
    async with AsyncGenerationClient(server.url, "http") as client:
        async with client.stream("hi") as stream:
            await stream.__anext__()


def test_http_error_status_is_one_generation_error():
    with SSEServer(status=400) as server, GenerationClient(server.url, "http") as client:
        with pytest.raises(GenerationError) as info:
            list(client.stream("hi", max_tokens=0))
        assert info.value.status == "400" and "max_tokens must be >= 1" in info.value.server_message
        with pytest.raises(GenerationError, match="max_tokens"):
            client.generate("hi", max_tokens=0)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unreachable_server_is_a_generation_error(protocol):
    url = f"127.0.0.1:{free_port()}"
    with GenerationClient(url, protocol) as client:
        with pytest.raises(GenerationError, match=f"cannot reach the {protocol} server at {url}"):
            client.generate("hi")

    async def run():
        async with AsyncGenerationClient(url, protocol) as client:
            await client.generate("hi")

    with pytest.raises(GenerationError, match=f"cannot reach the {protocol} server"):
        asyncio.run(run())


def test_sync_grpc_client_refuses_a_second_open_stream():
    with GenerationClient(f"127.0.0.1:{free_port()}", "grpc") as client:
        first = client.stream("a")
        with pytest.raises(RuntimeError, match="one gRPC stream at a time"):
            client.stream("b")
        first.close()
        second = client.stream("c")  # a closed stream frees the client
        with pytest.raises(GenerationError, match="cannot reach"):
            list(second)
        with pytest.raises(GenerationError, match="cannot reach"):
            client.generate("d")  # and so does a failed one


# --- CLI -----------------------------------------------------------------------------------


def test_cli_options_become_sampling_parameters():
    args = cli.build_parser().parse_args(
        [
            "chat",
            "hi",
            "--system",
            "brief",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--seed",
            "3",
            "--top-p",
            "0.9",
            "--top-k",
            "5",
            "--stop",
            "\n",
            "--stop",
            "END",
            "--protocol",
            "http",
            "--url",
            "h:1",
        ]
    )
    assert args.command == "chat" and args.prompt == "hi" and args.system == "brief" and args.protocol == "http"
    assert cli.sampling_from_args(args) == {
        "max_tokens": 8,
        "temperature": 0.0,
        "seed": 3,
        "top_p": 0.9,
        "top_k": 5,
        "stop": ["\n", "END"],
    }
    plain = cli.build_parser().parse_args(["generate", "x"])
    assert cli.sampling_from_args(plain) == {} and plain.protocol == "grpc"
    assert cli.sampling_from_args(cli.build_parser().parse_args(["generate", "x", "--ignore-eos"])) == {"ignore_eos": True}


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_cli_prompt_sources():
    parse = cli.build_parser().parse_args
    assert cli.read_prompt(parse(["generate", "x"]), io.StringIO("ignored")) == "x"
    assert cli.read_prompt(parse(["generate"]), io.StringIO("from a pipe\n")) == "from a pipe"
    assert cli.read_prompt(parse(["chat", "-"]), io.StringIO("piped\n")) == "piped"
    assert cli.read_prompt(parse(["chat"]), FakeTTY()) is None  # interactive
    with pytest.raises(cli.UsageError, match="no prompt"):
        cli.read_prompt(parse(["generate"]), io.StringIO("  \n"))


def test_cli_summary_line():
    line = cli.summary(Generation("x", "length", 12, 16, 0.25, 2.0))
    assert line == "finish_reason=length prompt_tokens=12 output_tokens=16 tokens/s=8.0 ttft=0.250s total=2.000s"
    assert cli.summary(Generation("", None, None, None, None, 0.1)) == "finish_reason=unknown total=0.100s"


def test_cli_exit_status_for_usage_and_unreachable_server():
    err = io.StringIO()
    assert cli.main(["generate", "x", "--max-tokens", "many"], stderr=err) == 2
    err = io.StringIO()
    assert cli.main(["generate", "x", "--timeout", "0"], stderr=err) == 2 and "timeout_s must be > 0" in err.getvalue()
    err = io.StringIO()
    assert cli.main(["generate"], stdin=io.StringIO(""), stderr=err) == 2 and "no prompt" in err.getvalue()
    for protocol in ("grpc", "http"):
        err, out = io.StringIO(), io.StringIO()
        status = cli.main(["chat", "hi", "--protocol", protocol, "--url", f"127.0.0.1:{free_port()}"], stdout=out, stderr=err)
        assert status == 1 and "cannot reach" in err.getvalue() and err.getvalue().count("\n") == 1


def test_cli_streams_pieces_and_prints_the_summary():
    with SSEServer() as server:
        out, err = io.StringIO(), io.StringIO()
        assert cli.main(["generate", "hi", "--protocol", "http", "--url", server.url], stdout=out, stderr=err) == 0
    assert out.getvalue() == "".join(TEXTS) + "\n"
    assert err.getvalue().startswith("finish_reason=length ") and f"output_tokens={len(TEXTS)}" in err.getvalue()


def test_cli_interactive_chat_keeps_the_history():
    with SSEServer() as server:
        lines = iter(["first question", "", "second question"])

        def read(prompt):
            try:
                return next(lines)
            except StopIteration:
                raise EOFError from None

        args = cli.build_parser().parse_args(["chat", "--protocol", "http", "--url", server.url, "-q", "--system", "brief"])
        with GenerationClient(server.url, "http") as client:
            assert cli.interactive(client, args, io.StringIO(), io.StringIO(), read=read) == 0
    sent = [json.loads(body["text_input"]) for body in server.bodies]
    assert len(sent) == 2
    assert sent[0] == [{"role": "system", "content": "brief"}, {"role": "user", "content": "first question"}]
    assert sent[1][1:] == [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "".join(TEXTS)},
        {"role": "user", "content": "second question"},
    ]
