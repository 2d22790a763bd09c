"""A model re-exported under the same version: after the encoder's reload the cache serves new vectors.

text_embedding_cached keys its entries by the encoder's version, variant and a fingerprint of
the served model file. The fingerprint used to be computed once per process, so a different
file under the same version, loaded into text_encoder, kept the old keys and the cache served
the old model's vectors. Here the server runs on a copy of the model repository (symlinks)
whose text_encoder/1/model.onnx is swapped for other weights (the INT8 export) in place.
"""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest
import tritonclient.http as httpclient

from server.layout import ROOT

CACHED, ENSEMBLE = "text_embedding_cached", "text_embedding"
SOURCE = ROOT / "model_repository" / "text_encoder" / "1"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    if not (SOURCE / "model.int8.onnx").is_file():
        pytest.skip("model.int8.onnx is not exported (run `make export`): no second set of weights")
    target = tmp_path_factory.mktemp("reexport") / "model_repository"
    shutil.copytree(
        (ROOT / "model_repository").resolve(), target, copy_function=os.symlink, ignore=shutil.ignore_patterns("__pycache__")
    )
    return target


@pytest.fixture(scope="module")
def server(start_triton, repo):
    with start_triton("triton-reexport-", (ENSEMBLE, CACHED), model_repository=repo) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.http_url)
    yield c
    c.close()


def embed(client, model: str, texts: list[str]) -> np.ndarray:
    data = np.array([[t.encode("utf-8")] for t in texts], dtype=object)
    inp = httpclient.InferInput("TEXT", list(data.shape), "BYTES")
    inp.set_data_from_numpy(data)
    return client.infer(model, [inp]).as_numpy("EMBEDDING")


def test_reexport_under_the_same_version_then_reload_serves_the_new_vectors(client, server, repo):
    texts = ["re-export: the same text before and after", "and a second one"]
    old = embed(client, CACHED, texts)
    assert np.array_equal(embed(client, CACHED, texts), old)  # cached (bit for bit)
    assert np.abs(embed(client, ENSEMBLE, texts) - old).max() < 1e-4

    # Other weights under the same version and file name, swapped in atomically, then a reload.
    served = repo / "text_encoder" / "1" / "model.onnx"
    incoming = served.with_name("model.onnx.incoming")
    os.symlink(SOURCE / "model.int8.onnx", incoming)
    os.replace(incoming, served)
    client.load_model("text_encoder")
    assert client.is_model_ready("text_encoder", "1")
    new_model = embed(client, ENSEMBLE, texts)
    assert np.abs(new_model - old).max() > 1e-3, "the reload did not change the encoder's vectors"

    after = embed(client, CACHED, texts)
    assert np.abs(after - new_model).max() < 1e-4, "the cache served the old model's vectors"
    assert np.array_equal(embed(client, CACHED, texts), after)  # and caches the new ones
    # Each instance (there are two) logs the identity it keys by when it changes: the old file's
    # fingerprint before the swap, the new one's after it, whichever instance served the request.
    fingerprints = set(re.findall(r"cache keys now for text_embedding \(.* file ([0-9a-f]+)\)", server.log_tail(400)))
    assert len(fingerprints) == 2, fingerprints
