import numpy as np
import pytest

from python_backends.errors import InputError
from python_backends.text.pooling import mean_pool


def test_masked_mean_and_norm():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(2, 4, 8)).astype(np.float32)
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=np.int64)
    out = mean_pool(emb, mask)
    expected0 = emb[0, :2].mean(axis=0)
    expected0 /= np.linalg.norm(expected0)
    np.testing.assert_allclose(out[0], expected0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-6)
    # padding must not matter: change the padded positions, same result
    emb[0, 2:] = 1000.0
    np.testing.assert_allclose(mean_pool(emb, mask)[0], out[0], rtol=1e-6)


def test_without_normalisation():
    emb = np.ones((1, 3, 2), dtype=np.float32) * 2
    out = mean_pool(emb, np.array([[1, 1, 0]]), normalize=False)
    np.testing.assert_allclose(out, [[2.0, 2.0]])


def test_errors_name_the_input():
    emb = np.zeros((1, 3, 2), dtype=np.float32)
    with pytest.raises(InputError, match=r"attention_mask: shape \[1, 4\] does not match"):
        mean_pool(emb, np.ones((1, 4), dtype=np.int64))
    with pytest.raises(InputError, match=r"attention_mask\[0\]: has no real token"):
        mean_pool(emb, np.zeros((1, 3), dtype=np.int64))
    with pytest.raises(InputError, match="token_embeddings: expected 3 dims"):
        mean_pool(np.zeros((3, 2), dtype=np.float32), np.ones((3,), dtype=np.int64))
