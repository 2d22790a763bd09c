"""An OpenAI-compatible API (``/v1/embeddings``, ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``) in front of the Triton models, over one shared gRPC channel.

An ASGI app (FastAPI on uvicorn). It checks every request (API key, rate limit, body and
input limits) before Triton sees it, turns OpenAI requests into Triton requests on the
models of this repository, and Triton's answers back into OpenAI's JSON and SSE shapes.
Model limits (batch size, token limits, tokenizer) are read from their config.pbtxt.

    python -m openai_gateway --triton 127.0.0.1:8001      # make serve starts it on :8080

See docs/openai-gateway.md.
"""
