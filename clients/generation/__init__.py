"""Clients of the ``text_generation`` model: whole answers and token streams, sync and asyncio.

The served model has the interface of Triton's vLLM backend (``text_input``, ``stream``,
``sampling_parameters`` JSON, ``exclude_input_in_output``, ``return_*``) plus this project's
``apply_chat_template`` (``text_input`` is then a JSON list of ``{"role", "content"}``
messages that the server renders with the model's chat template). Two transports:

- gRPC: the bidirectional stream of tritonclient (decoupled responses; the last one carries
  ``triton_final_response``). A whole answer is one request with ``stream`` false.
- HTTP: Triton's generate extension, ``POST /v2/models/<model>/generate`` (one JSON object)
  and ``/generate_stream`` (Server-Sent Events, one ``data: {...}`` event per text piece).

All sampling parameters travel in ``sampling_parameters`` on both protocols: Triton's
generate endpoint refuses a list (``stop``) as a request parameter.

    from clients.generation import GenerationClient

    with GenerationClient("127.0.0.1:8001", protocol="grpc") as client:
        answer = client.chat([{"role": "user", "content": "Capital of France?"}], max_tokens=16)
        print(answer.text, answer.finish_reason, answer.tokens_per_s)
        with client.stream("Once upon a time", max_tokens=64) as pieces:
            for piece in pieces:
                print(piece, end="", flush=True)
        print(pieces.result)

Closing a stream before its end (``close()``, leaving the ``with`` block, Ctrl-C) cancels
the request on the server: gRPC cancels the call, HTTP closes the connection; either way the
model sees the request cancelled and frees its KV blocks.

Several URLs (a list or ``"a:8001,b:8001"``) fail over as the embedding clients do
(clients/resilience.py): a request refused as UNAVAILABLE, or whose connection fails, is sent
again, to another endpoint when there is one, but only until its first response arrived;
after that an error is the caller's (the text already read cannot be taken back).

The package, by role: ``request.py`` (what is sent: sampling fields, chat messages, the
model's inputs, connection options), ``response.py`` (what comes back: pieces, the finished
Generation, GenerationError), ``grpc_transport.py`` and ``http_transport.py`` (one attempt
on one endpoint, blocking and asyncio), ``client.py`` (GenerationClient, and the constructor
and calls both clients share: GenerationBase) and ``aio.py`` (AsyncGenerationClient);
``cli.py`` is ``python -m clients generate|chat``. What the embedding clients share with these
(URLs, connections, errors, retries) is clients/transport.py, errors.py and resilience.py.
Every name is importable from ``clients.generation``.
"""

from clients.generation.aio import AsyncGenerationClient, AsyncTextStream
from clients.generation.client import GenerationClient, TextStream, chat, generate
from clients.generation.grpc_transport import STOP_TIMEOUT_S
from clients.generation.request import (
    DEFAULT_MODEL,
    ROLES,
    SAMPLING_FIELDS,
    GenerateRequest,
    GenerationOptions,
    chat_messages,
    sampling_parameters,
)
from clients.generation.response import (
    Generation,
    GenerationError,
    Piece,
    SSEDecoder,
    Tracker,
    http_error,
    is_final,
    piece_from_json,
    piece_from_result,
    transport_error,
)

__all__ = [
    "DEFAULT_MODEL",
    "ROLES",
    "SAMPLING_FIELDS",
    "STOP_TIMEOUT_S",
    "AsyncGenerationClient",
    "AsyncTextStream",
    "GenerateRequest",
    "Generation",
    "GenerationClient",
    "GenerationError",
    "GenerationOptions",
    "Piece",
    "SSEDecoder",
    "TextStream",
    "Tracker",
    "chat",
    "chat_messages",
    "generate",
    "http_error",
    "is_final",
    "piece_from_json",
    "piece_from_result",
    "sampling_parameters",
    "transport_error",
]
