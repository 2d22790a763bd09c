"""Softmax and top-k with labels (python_backends.image.postprocess), and the labels file."""

import numpy as np
import pytest

from contract.errors import ConfigError, InputError
from export.image_classifier import LABELS
from python_backends.image.postprocess import TopKClassifier, load_labels, softmax


def test_softmax_is_stable_and_normalised():
    logits = np.array([[1000.0, 1001.0, 999.0], [-1e4, 0.0, -1e4], [0.0, 0.0, 0.0]], dtype=np.float32)
    p = softmax(logits)
    assert p.dtype == np.float32 and np.isfinite(p).all()
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-6)
    e = np.exp([0.0, 1.0, -1.0])
    np.testing.assert_allclose(p[0], e / e.sum(), rtol=1e-6)
    np.testing.assert_allclose(p[1], [0.0, 1.0, 0.0], atol=1e-30)
    np.testing.assert_allclose(p[2], 1 / 3, rtol=1e-6)


def test_top_k_labels_indices_scores():
    classify = TopKClassifier(["cat", "dog", "fish", "bird"], k=3)
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 0.0, 0.0]], dtype=np.float32)
    top = classify(logits)
    assert top.indices.tolist() == [[1, 3, 2], [0, 2, 3]]  # ties keep index order
    assert top.labels.tolist() == [[b"dog", b"bird", b"fish"], [b"cat", b"fish", b"bird"]]
    assert top.indices.dtype == np.int64 and top.scores.dtype == np.float32
    np.testing.assert_allclose(top.scores, np.take_along_axis(softmax(logits), top.indices, axis=1))
    assert (np.diff(top.scores, axis=1) <= 0).all()


def test_bad_logits_are_input_errors():
    classify = TopKClassifier(["a", "b"], k=1)
    with pytest.raises(InputError, match=r"logits: expected shape \[n, 2\], got \[1, 3\]"):
        classify(np.zeros((1, 3), np.float32))
    with pytest.raises(InputError, match=r"logits\[1\]: contains NaN or infinity"):
        classify(np.array([[0, 1], [np.nan, 0]], np.float32))


def test_per_request_isolates_a_bad_request():
    classify = TopKClassifier(["a", "b", "c"], k=2)
    good = np.array([[0.0, 2.0, 1.0]], np.float32)
    two = np.array([[3.0, 2.0, 1.0], [0.0, 0.0, 9.0]], np.float32)
    bad = np.array([[np.inf, 0.0, 0.0]], np.float32)
    results = classify.per_request([good, two, bad, good])
    assert results[0].indices.tolist() == [[1, 2]]
    assert results[1].indices.tolist() == [[0, 1], [2, 0]]
    assert isinstance(results[2], InputError)
    assert results[3].labels.tolist() == [[b"b", b"c"]]
    # the batched path (no bad request) splits the same way
    batched = classify.per_request([good, two])
    assert [r.indices.tolist() for r in batched] == [[[1, 2]], [[0, 1], [2, 0]]]
    assert classify.per_request([]) == []


def test_k_must_fit_the_classes():
    with pytest.raises(ConfigError, match="top_k must be between 1 and the number of classes"):
        TopKClassifier(["a", "b"], k=3)
    with pytest.raises(ConfigError):
        TopKClassifier(["a", "b"], k=0)


def test_imagenet_labels_file():
    labels = load_labels(LABELS, expected=1000)
    assert labels[0] == "tench" and labels[1] == "goldfish" and labels[281] == "tabby" and labels[999] == "toilet tissue"
    assert all(label == label.strip() and label for label in labels)
    # Two ImageNet classes share a name each (crane: bird and machine; maillot twice).
    dupes = sorted({label for label in labels if labels.count(label) > 1})
    assert dupes == ["crane", "maillot"]


def test_load_labels_checks(tmp_path):
    path = tmp_path / "labels.txt"
    with pytest.raises(ConfigError, match="labels file not found"):
        load_labels(path)
    path.write_text("a\nb\n\n")
    assert load_labels(path, expected=2) == ["a", "b"]
    with pytest.raises(ConfigError, match="has 2 labels; the model has 3 classes"):
        load_labels(path, expected=3)
    path.write_text("a\n \nc\n")
    with pytest.raises(ConfigError, match="line 2 is blank"):
        load_labels(path)
