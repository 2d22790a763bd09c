"""tritonserver's own words that contract/prose.py reads, made by the real server: a gRPC stream
error carries no status, so the gateway and the clients tell "cannot reach the model now" (503,
retry) from a failure by these words alone."""

from __future__ import annotations

import queue

import numpy as np

from contract.prose import says_retry, triton_unavailable


def test_a_stream_to_an_unknown_model_is_worded_as_unavailable(triton):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        text = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"hello"]], dtype=object))
        client.async_stream_infer("no_such_model", [text])
        result, error = responses.get(timeout=30)
    finally:
        client.stop_stream()
        client.close()
    assert result is None and error is not None
    message = error.message() or str(error)
    assert triton_unavailable(message), message
    assert not says_retry("a request the model refused: TEXT[0]: text contains only whitespace")
