"""``/health`` (the process is up), ``/health/ready`` (Triton and a model are), ``/metrics``."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from openai_gateway.errors import APIError
from openai_gateway.responses import error_response, json_response
from openai_gateway.state import gateway_state

router = APIRouter()


@router.get("/health", include_in_schema=False)
async def health():
    """Liveness: 200 while the process answers."""
    return json_response(200, b'{"status":"ok"}')


@router.get("/health/ready", include_in_schema=False)
async def health_ready(request: Request):
    """Readiness: 200 with the served models, 503 while Triton or every model is down."""
    st = gateway_state(request)
    backend = st.backend
    served = [m.id for m in backend.served()]
    st.metrics.triton_ready.set(1 if backend.server_ready and served else 0)
    if not backend.server_ready:
        return error_response(
            APIError(
                503, f"Triton at {st.settings.triton_url} is not ready", code="triton_unavailable", headers={"Retry-After": "1"}
            )
        )
    if not served:
        return error_response(
            APIError(503, "no model is ready in Triton", code="triton_unavailable", headers={"Retry-After": "1"})
        )
    return json_response(200, orjson.dumps({"status": "ready", "models": served}))


@router.get("/metrics", include_in_schema=False)
async def prometheus(request: Request):
    """The gateway's metrics in Prometheus' text format."""
    st = gateway_state(request)
    st.metrics.triton_ready.set(1 if st.backend.server_ready else 0)
    return Response(st.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")
