"""The error contract: errors cross every hop as data (code, field, values), and every reader
(the shim, the gateway, the clients, the retry policy) takes them from the data."""

from __future__ import annotations

import pytest
from tritonclient.utils import InferenceServerException

from clients.generation.response import GenerationError, transport_error
from clients.resilience import is_retryable
from contract.errors import (
    CODES,
    GRPC_STATUS,
    HTTP_STATUS,
    MARK,
    TRITON_CODES,
    InputError,
    Overloaded,
    RequestError,
    Unavailable,
    error_from_message,
    format_error,
    parse_error,
    words_of,
)
from python_backends.generation.scheduler import ContextTooLong, QueueFull
from python_backends.shim import error_response
from tests.unit.triton_fakes import make_pb_utils


def test_every_code_has_a_status_on_every_protocol():
    assert set(TRITON_CODES) == set(GRPC_STATUS) == set(HTTP_STATUS) == set(CODES)
    with pytest.raises(ValueError, match="unknown error code"):
        RequestError("x", "y", code="no_such_code")


@pytest.mark.parametrize(
    "exc, code, field, values",
    [
        (
            InputError("top_p", "must be in (0, 1], got 2", values={"maximum": 1, "got": 2}),
            "invalid_value",
            "top_p",
            {"maximum": 1, "got": 2},
        ),
        (
            ContextTooLong(4086, 16, 4096),
            "context_length_exceeded",
            "max_tokens",
            {"prompt_tokens": 4086, "max_tokens": 16, "limit": 4096},
        ),
        (QueueFull(5, 32, 4), "overloaded", None, {"waiting": 5, "max_num_seqs": 32, "max_waiting": 4}),
        (Unavailable("the model is unloading"), "unavailable", None, {}),
        (Overloaded("no capacity in class bulk"), "overloaded", None, {}),
    ],
)
def test_format_and_parse_round_trip_whatever_is_put_in_front(exc, code, field, values):
    text = format_error(exc)
    for received in (text, "in ensemble 'text_embedding', " + text, "text_generation: " + text):
        data = parse_error(received)
        assert data is not None and (data.code, data.field, data.values) == (code, field, values)
        assert MARK not in words_of(received) and str(exc) in words_of(received)


def test_messages_without_data_are_not_guessed_at():
    for text in ("max_tokens: must be <= 2048, got 5000", "x #error-data not json", 'x #error-data {"code": "nope"}', ""):
        assert parse_error(text) is None
    assert words_of("plain") == "plain"
    # An unexpected exception is an internal error, data included.
    assert parse_error(format_error(RuntimeError("boom"))).code == "internal"


def test_the_shim_picks_tritons_code_from_the_errors_code():
    pb = make_pb_utils()
    for exc, name in (
        (InputError("stop", "must not be empty"), "INVALID_ARG"),
        (ContextTooLong(10, 4090, 4096), "INVALID_ARG"),
        (InputError("text_input", "too big", code="request_too_large"), "INVALID_ARG"),
        (QueueFull(1, 1, 1), "UNAVAILABLE"),
        (Unavailable("unloading"), "UNAVAILABLE"),
        (RuntimeError("boom"), "INTERNAL"),
    ):
        response = error_response(pb, "text_generation", exc)
        assert response.error().code() == getattr(pb.TritonError, name), exc
        assert parse_error(response.error().message()) is not None


def test_a_stream_error_gets_its_status_and_fields_from_the_data():
    stream = InferenceServerException(format_error(QueueFull(3, 32, 3)))  # a stream's: no status
    err = transport_error(stream, "grpc", "127.0.0.1:8001", "text_generation", 60)
    assert isinstance(err, GenerationError)
    assert (err.status, err.code, err.values["max_waiting"]) == ("StatusCode.UNAVAILABLE", "overloaded", 3)
    assert MARK not in str(err) and "max_waiting=3" in err.server_message
    bad = transport_error(
        InferenceServerException(format_error(InputError("top_k", "must be >= 0"))), "grpc", "u", "text_generation", 60
    )
    assert (bad.status, bad.field) == ("StatusCode.INVALID_ARGUMENT", "top_k")


def test_retries_follow_the_code_not_the_words():
    overloaded = InferenceServerException(format_error(QueueFull(3, 32, 3)))
    assert is_retryable(overloaded)
    # Words that look like a load-shedding rejection do not make a bad request retryable.
    bad = InferenceServerException(format_error(InputError("stop", "unavailable is not a stop string")))
    assert not is_retryable(bad)
    assert is_retryable(InferenceServerException(format_error(Unavailable("unloading"))))


def test_an_error_from_another_hop_keeps_its_code_field_and_values():
    text = "in ensemble 'text_embedding', " + format_error(InputError("TEXT[2]", "text is empty", values={"index": 2}))
    error = error_from_message(text, "text_embedding failed: ")
    assert isinstance(error, RequestError)
    assert (error.code, error.field, error.values) == ("invalid_value", "TEXT[2]", {"index": 2})
    assert str(error) == "TEXT[2]: text_embedding failed: text is empty"
    plain = error_from_message("Stub process is not healthy", "text_embedding failed: ")
    assert type(plain) is RuntimeError and str(plain) == "text_embedding failed: Stub process is not healthy"


def test_each_public_protocol_carries_the_data_where_it_reads_it():
    """HTTP: the body's own keys; gRPC unary: trailing metadata; a gRPC stream: after the words."""
    from contract.errors import ERROR_METADATA, ErrorData, data_from_body, data_json, error_body, error_data, public_body

    error = ContextTooLong(4086, 16, 4096)
    inside = {"error": "in ensemble 'x', " + format_error(error)}  # as tritonserver answers it
    body = public_body(inside)
    assert body is not None and MARK not in body["error"] and body["error"].startswith("in ensemble 'x', max_tokens: ")
    assert (body["code"], body["field"], body["values"]) == ("context_length_exceeded", "max_tokens", error.values)
    assert data_from_body(body) == ErrorData(body["code"], "max_tokens", error.values, body["error"])
    assert data_from_body(error_body(data_from_body(body))) == data_from_body(body)
    assert public_body({"error": "Request for unknown model"}) is None  # tritonserver's own: as it came
    assert data_from_body({"error": "x", "code": "no_such_code"}) is None

    class Rpc(Exception):  # a grpc.RpcError as a unary call through the gRPC door ends
        def details(self):
            return body["error"]

        def trailing_metadata(self):
            return (("other", "1"), (ERROR_METADATA, data_json(error.data)))

    unary = error_data(Rpc())
    assert unary is not None and (unary.code, unary.values, unary.message) == (error.code, error.values, body["error"])
    stream = error_data(InferenceServerException(format_error(error)))  # a stream's error_message
    assert stream is not None and stream.code == error.code and MARK not in stream.message
    assert error_data(InferenceServerException("Request for unknown model")) is None
