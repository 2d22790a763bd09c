"""The words contract/prose.py reads, made by the components that write them where they run here
(ONNX Runtime, tritonclient, Pillow); tritonserver's own are made by a real server in
tests/integration/test_prose_wording.py. A component that rewords its message fails here."""

from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from contract.prose import (
    onnxruntime_invalid_input,
    pillow_truncated,
    says_retry,
    triton_live_models,
    triton_unavailable,
    tritonclient_undecodable,
)


def test_onnx_runtime_words_an_id_beyond_the_vocabulary_as_invalid_argument():
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    table = helper.make_tensor("table", TensorProto.FLOAT, [4, 2], [0.0] * 8)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["out"])],
        "lookup",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2])],
        [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as info:
        session.run(None, {"ids": np.array([99], dtype=np.int64)})
    assert onnxruntime_invalid_input(str(info.value)), str(info.value)
    # the native onnxruntime backend's form (its status text, no Python API in between)
    assert onnxruntime_invalid_input("onnx runtime error 2: Non-zero status code returned while running Gather node")
    assert not onnxruntime_invalid_input("onnx runtime error 6: Non-zero status code returned while running MatMul node")


class _ProxyErrorPage(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b"<html><body><h1>502 Bad Gateway</h1></body></html>"
        self.send_response(502)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_tritonclient_words_a_proxy_error_page_as_undecodable():
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    server = ThreadingHTTPServer(("127.0.0.1", 0), _ProxyErrorPage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.server_address[1]}")
        text = httpclient.InferInput("TEXT", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"hello"]], dtype=object))
        with pytest.raises(InferenceServerException) as info:
            client.infer("text_embedding", [text])
        client.close()
    finally:
        server.shutdown()
        server.server_close()
    assert info.value.status() == "502"
    assert tritonclient_undecodable(info.value.message() or str(info.value)), info.value.message()
    assert not tritonclient_undecodable("Request for unknown model: 'x' is not found")


def test_pillow_words_a_cut_file_as_truncated():
    from PIL import Image, ImageFile

    buffer = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buffer, format="PNG")
    png = buffer.getvalue()
    assert not ImageFile.LOAD_TRUNCATED_IMAGES
    with pytest.raises(OSError) as info:
        Image.open(io.BytesIO(png[: len(png) // 2])).load()
    assert pillow_truncated(str(info.value)), str(info.value)
    assert not pillow_truncated("cannot identify image file")


@pytest.mark.parametrize(
    "message, unavailable, retry",
    [
        # tritonserver 2.51's words (src/grpc, src/core), as tests/integration/test_prose_wording.py reads them
        ("Request for unknown model: 'text_generation' is not found", True, False),
        ("Request for unknown model: 'text_encoder' version 1 is not at ready state", True, False),
        ("Exceeds maximum queue size", False, True),
        ("in ensemble 'text_embedding', Exceeds maximum queue size", False, True),
        ("model 'text_generation' is unavailable", True, True),
        ("tokenizer step: invalid value", False, False),
    ],
)
def test_the_words_read_for_tritonserver(message, unavailable, retry):
    assert triton_unavailable(message) is unavailable
    assert says_retry(message) is retry


def test_the_shutdown_line_read_for_tritonserver():
    # tritonserver 2.51's own lines while it shuts down (its log, as the launcher keeps it)
    waiting = 'I1207 10:15:57.485 17203 server.cc:345] "Timeout 28: Found 2 live models and 0 in-flight non-inference requests"'
    busy = 'I1207 10:15:56.485 17203 server.cc:345] "Timeout 29: Found 2 live models and 1 in-flight non-inference requests"'
    assert triton_live_models(["loading", waiting]) == 2
    assert triton_live_models([waiting, busy]) is None  # the latest line counts: a request is still in flight
    assert triton_live_models(["nothing about it"]) is None


class _DataErrorBody(BaseHTTPRequestHandler):
    """An error as the front door answers it: the data as the body's own keys."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"error":"TEXT[0]: text is empty","code":"invalid_value","field":"TEXT[0]","values":{}}'
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_tritonclient_http_keeps_only_an_error_bodys_words_and_posts_through_post():
    """What clients.transport's client relies on: tritonclient.http makes its exception of the body's
    "error" alone, and its infer POSTs through ``_post``, where the clients read the body first."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from clients.errors import ServerError
    from clients.transport import triton_client

    server = ThreadingHTTPServer(("127.0.0.1", 0), _DataErrorBody)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"127.0.0.1:{server.server_address[1]}"
    text = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b""]], dtype=object))
    try:
        plain = httpclient.InferenceServerClient(url)
        with pytest.raises(InferenceServerException) as info:
            plain.infer("text_embedding", [text])
        plain.close()
        keeping = triton_client("http", url)
        with pytest.raises(ServerError) as kept:
            keeping.infer("text_embedding", [text])
        keeping.close()
    finally:
        server.shutdown()
        server.server_close()
    assert info.value.message() == "TEXT[0]: text is empty" and not hasattr(info.value, "error_data")
    assert kept.value.message() == "TEXT[0]: text is empty" and kept.value.status() == "400"
    assert (kept.value.error_data.code, kept.value.error_data.field) == ("invalid_value", "TEXT[0]")


def test_tritonclient_grpc_keeps_the_grpc_error_with_its_metadata_as_context():
    """tritonclient.grpc's exception has the details and status only; the RpcError it was raised
    while handling, with the trailing metadata the gRPC door puts an error's data in, is its context."""
    from concurrent import futures

    import grpc
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from contract.errors import ERROR_METADATA, error_data
    from contract.prose import tritonclient_rpc_error

    data = '{"code":"invalid_value","field":"TEXT[0]","values":{"limit":1}}'

    def infer(request, context):
        context.set_trailing_metadata(((ERROR_METADATA, data),))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "TEXT[0]: text is empty")

    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer, request_deserializer=lambda b: b, response_serializer=bytes)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        text = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b""]], dtype=object))
        with pytest.raises(InferenceServerException) as info:
            client.infer("text_embedding", [text])
        client.close()
    finally:
        server.stop(0)
    assert info.value.message() == "TEXT[0]: text is empty" and info.value.status() == "StatusCode.INVALID_ARGUMENT"
    rpc = tritonclient_rpc_error(info.value)
    assert rpc is not None and dict(rpc.trailing_metadata())[ERROR_METADATA] == data
    found = error_data(info.value)
    assert found is not None and (found.code, found.field, found.values) == ("invalid_value", "TEXT[0]", {"limit": 1})
    assert tritonclient_rpc_error(InferenceServerException("a stream's error")) is None
