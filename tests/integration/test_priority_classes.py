"""Priority classes on a real tritonserver (docs/priority-classes.md): each class's entry
answers, a request naming another class is told where to go, and a flood of one class is
refused with UNAVAILABLE while the other classes are served."""

import asyncio
import json
import time
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from python_backends.admission.classes import CACHED_ENTRIES

pytestmark = pytest.mark.integration


def _post(server, model, texts, parameters=None):
    body = {"inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]}
    if parameters:
        body["parameters"] = parameters
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _vector(reply):
    out = next(o for o in reply["outputs"] if o["name"] == "EMBEDDING")
    return np.array(out["data"], dtype=np.float32).reshape(out["shape"])


def test_every_class_entry_gives_the_default_entrys_vectors(triton):
    texts = [f"priority classes share one model {uuid.uuid4().hex}", "a second sentence"]
    status, default = _post(triton, "text_embedding", texts)
    assert status == 200
    for model in CACHED_ENTRIES.values():
        status, reply = _post(triton, model, texts)
        assert status == 200, (model, reply)
        np.testing.assert_allclose(_vector(reply), _vector(default), atol=1e-5, err_msg=model)
    status, reply = _post(triton, "text_embedding_interactive", texts)
    assert status == 200
    np.testing.assert_allclose(_vector(reply), _vector(default), atol=1e-5)


def test_a_request_for_another_class_gets_400_naming_the_entry_that_serves_it(triton):
    status, reply = _post(triton, "text_embedding_cached", ["hello"], {"priority_class": "interactive"})
    assert status == 400 and "priority_class" in reply["error"] and CACHED_ENTRIES["interactive"] in reply["error"]
    status, reply = _post(triton, "text_embedding_cached_bulk", ["hello"], {"priority_class": "urgent"})
    assert status == 400 and "priority_class" in reply["error"] and "interactive, default, bulk" in reply["error"]
    status, _ = _post(triton, "text_embedding_cached_bulk", ["hello"], {"priority_class": "bulk"})
    assert status == 200


async def _flood(url, model, n, nonce):
    client = grpcaio.InferenceServerClient(url)
    try:

        async def one(i):
            inp = grpcaio.InferInput("TEXT", [1, 1], "BYTES")
            inp.set_data_from_numpy(np.array([[f"flood {nonce} number {i} with some words".encode()]], dtype=object))
            t0 = time.perf_counter()
            try:
                await client.infer(model, [inp], client_timeout=60)
                return "ok", time.perf_counter() - t0, ""
            except InferenceServerException as exc:
                return exc.status(), time.perf_counter() - t0, exc.message()

        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


async def _flood_and_probe(url, nonce):
    flood = asyncio.ensure_future(_flood(url, CACHED_ENTRIES["bulk"], 400, nonce))
    await asyncio.sleep(0.05)
    probe = await _flood(url, CACHED_ENTRIES["interactive"], 5, nonce + "-interactive")
    return await flood, probe


def test_a_flood_of_bulk_is_refused_with_unavailable_and_interactive_is_served(triton):
    results, probe = asyncio.run(_flood_and_probe(triton.grpc_url, uuid.uuid4().hex))
    outcomes = {}
    for status, _, _ in results:
        outcomes[status] = outcomes.get(status, 0) + 1
    print("bulk flood outcomes:", outcomes)
    assert set(outcomes) <= {"ok", "StatusCode.UNAVAILABLE"}, [
        r for r in results if r[0] not in ("ok", "StatusCode.UNAVAILABLE")
    ][:3]
    assert outcomes.get("ok", 0) >= 1, "bulk was admitted while its lane had room"
    assert outcomes.get("StatusCode.UNAVAILABLE", 0) > 0, "400 simultaneous misses over a 16-row limit: some refused"
    refusal = next(msg for status, _, msg in results if status == "StatusCode.UNAVAILABLE")
    assert "'bulk' is at capacity (16 rows" in refusal and "retry" in refusal
    assert [s for s, _, _ in probe] == ["ok"] * 5, probe
    # after the flood the class is admitted again
    assert [s for s, _, _ in asyncio.run(_flood(triton.grpc_url, CACHED_ENTRIES["bulk"], 3, uuid.uuid4().hex))] == ["ok"] * 3


def _post_raw(server, model, text):
    body = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_the_front_door_refuses_a_class_over_its_in_flight_limit_with_503(triton):
    """64 HTTP requests at once to the bulk entry (admission_rows 16): the front door lets 16
    through and answers the rest 503 itself, naming the class and the model, with Retry-After;
    never a 500. The interactive entry is served meanwhile, and bulk is admitted again after."""
    from concurrent.futures import ThreadPoolExecutor

    if not triton.options.front_door:
        pytest.skip("the in-flight limit is the front door's; this server runs without it")
    nonce = uuid.uuid4().hex
    with ThreadPoolExecutor(72) as pool:
        flood = [
            pool.submit(_post_raw, triton, CACHED_ENTRIES["bulk"], f"http flood {nonce} {i} with a few more words")
            for i in range(64)
        ]
        time.sleep(0.05)
        probe = [pool.submit(_post_raw, triton, CACHED_ENTRIES["interactive"], f"probe {nonce} {i}") for i in range(4)]
        results = [f.result() for f in flood]
        probed = [f.result()[0] for f in probe]
    statuses = sorted(s for s, _, _ in results)
    print("bulk HTTP flood statuses:", {s: statuses.count(s) for s in set(statuses)})
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 16, "the first 16 in flight are admitted"
    refused = [(h, b) for s, h, b in results if s == 503]
    assert refused, "64 at once over a 16-request limit: some refused"
    headers, body = refused[0]
    message = json.loads(body)["error"]
    assert json.loads(body)["code"] == "overloaded", body  # the data as the body's keys (contract/errors.py)
    assert "priority class bulk" in message and CACHED_ENTRIES["bulk"] in message and "retry" in message, message
    assert headers.get("Retry-After") == "1", headers
    assert probed == [200] * 4, probed
    assert _post_raw(triton, CACHED_ENTRIES["bulk"], f"after the flood {nonce}")[0] == 200


def test_the_gateway_sends_each_class_to_its_entry(openai_client, triton):
    """X-Priority-Class picks the class's entry; the vectors are the same model's."""
    text = f"gateway priority class {uuid.uuid4().hex}"
    plain = openai_client.embeddings.create(model="text_embedding", input=[text]).data[0].embedding
    for cls in ("interactive", "default", "bulk"):
        got = (
            openai_client.embeddings.create(model="text_embedding", input=[text], extra_headers={"X-Priority-Class": cls})
            .data[0]
            .embedding
        )
        np.testing.assert_allclose(got, plain, atol=1e-5, err_msg=cls)
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        openai_client.embeddings.create(model="text_embedding", input=["x"], extra_headers={"X-Priority-Class": "urgent"})
    assert err.value.body["param"] == "X-Priority-Class" and "interactive" in err.value.body["message"]
    # the interactive entry served it: its statistics counted the request
    with urllib.request.urlopen(f"http://{triton.http_url}/v2/models/{CACHED_ENTRIES['interactive']}/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]["inference_stats"]["success"]["count"]
    assert stats >= 1
