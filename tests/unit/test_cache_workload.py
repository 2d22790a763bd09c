"""perf.bench.cache_bench's workload: deterministic distinct sentences and a Zipf stream."""

import numpy as np
import pytest

from perf.bench.cache_workload import DISTINCT, repeat_fraction, sentences, zipf_ranks


def test_ten_thousand_distinct_sentences_the_same_every_time():
    a = sentences()
    assert len(a) == DISTINCT == len(set(a))
    assert a == sentences()
    assert a != sentences(seed=6)
    assert all(t[0].isupper() and t.endswith(".") and 8 <= len(t.split()) <= 12 for t in a)


def test_zipf_stream_is_deterministic_and_skewed():
    ranks = zipf_ranks(20000)
    assert np.array_equal(ranks, zipf_ranks(20000))
    assert ranks.min() >= 0 and ranks.max() < DISTINCT
    counts = np.bincount(ranks, minlength=DISTINCT)
    # P(rank 1) = 1 / H(10000) = 10.2 % for s = 1; rank 2 half as often
    assert 0.09 < counts[0] / len(ranks) < 0.115
    assert 1.6 < counts[0] / counts[1] < 2.5
    assert 0.7 < repeat_fraction(ranks) < 0.85
    assert repeat_fraction(zipf_ranks(20000, s=1.5)) > repeat_fraction(ranks)
    with pytest.raises(ValueError):
        zipf_ranks(0)
