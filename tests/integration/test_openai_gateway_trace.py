"""The gateway's request id is the Triton request's id: Triton's own trace of the request carries it."""

from __future__ import annotations

import json
import time
import uuid

import requests

from tests.integration.conftest import GATEWAY_TEST_KEY


def _trace(triton, level: str) -> None:
    r = requests.post(
        f"http://{triton.triton_http_url}/v2/trace/setting",
        json={"trace_level": [level], "trace_rate": "1", "trace_count": "-1", "log_frequency": "1"},
        timeout=10,
    )
    assert r.status_code == 200, r.text


def _traced_request_ids(trace_file) -> set[str]:
    ids = set()
    for path in trace_file.parent.glob(trace_file.name + "*"):
        text = path.read_text(encoding="utf-8").strip()
        if not text:
            continue
        if not text.endswith("]"):  # a file being written: close the list to read what is there
            text = text.rstrip(",") + "]"
        try:
            entries = json.loads(text)
        except json.JSONDecodeError:
            continue
        ids |= {e["request_id"] for e in entries if isinstance(e, dict) and e.get("request_id")}
    return ids


def test_the_request_id_reaches_triton(gateway, triton, trace_file):
    request_id = f"trace-{uuid.uuid4().hex[:12]}"
    _trace(triton, "TIMESTAMPS")
    try:
        r = requests.post(
            f"{gateway.url}/v1/embeddings",
            timeout=60,
            headers={"Authorization": f"Bearer {GATEWAY_TEST_KEY}", "X-Request-Id": request_id},
            json={"model": "text_embedding", "input": f"traced text {request_id}"},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == request_id
        deadline = time.monotonic() + 10
        while request_id not in _traced_request_ids(trace_file) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        _trace(triton, "OFF")
    found = {p.name: p.stat().st_size for p in trace_file.parent.iterdir()}
    assert request_id in _traced_request_ids(trace_file), f"{request_id} not in Triton's trace files {found}"
