"""The gateway's endpoints, one router per group (``create_app`` includes them in this order):

- ``health``: ``/health``, ``/health/ready``, ``/metrics`` (no key)
- ``models``: ``/v1/models``, ``/v1/models/{model}``
- ``embeddings``: ``/v1/embeddings``
- ``completions``: ``/v1/chat/completions``, ``/v1/completions``
- ``responses``: ``/v1/responses`` (and ``GET``/``DELETE`` ``/v1/responses/{id}``, ``/input_items``)
- ``tokenize``: ``/tokenize``, ``/detokenize`` (vLLM's paths; a key as for ``/v1``)
- ``rerank``: ``/v1/rerank`` (and ``/rerank``, ``/v2/rerank``), ``/score`` (and ``/v1/score``)
- ``files``, ``batches``: the Batch API, ``/v1/files[/{id}[/content]]`` and ``/v1/batches[/{id}[/cancel]]``

Every ``/v1`` route (and the tokenize pair) has passed the gate (key, rate limit, body size) before it runs; a route
parses its body, checks it, asks Triton and writes the answer.
"""

from fastapi.security import HTTPBearer

# Declares the key in /openapi.json; the gate (openai_gateway/gate.py) is what checks it.
bearer = HTTPBearer(auto_error=False, description="An API key of the gateway")
