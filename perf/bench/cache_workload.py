"""The repeated-text workload of perf.bench.cache_bench: 10,000 distinct sentences and a Zipf stream.

Sentences are built from the word lists below with a seeded generator (this module is the
checked-in data: the same seed gives the same sentences and the same stream on every
machine). They read like short English sentences of 8 to 12 words (11 to 16 tokens with [CLS] and
[SEP]), so every one falls in the tokenizer's 16-token bucket, like perf/data/sentences_16tok.json.

The stream draws sentence ranks from a Zipf distribution truncated to the 10,000 sentences
(P(rank k) proportional to 1 / k**s, s = 1 by default): a few sentences are very frequent,
most are rare, the shape of real query logs. With s = 1 and 20,000 requests, 78 % of the
requests repeat an earlier sentence (the hit rate an unbounded cache would reach).
"""

from __future__ import annotations

import numpy as np

SUBJECTS = """the old farmer|a young doctor|my neighbour|the new teacher|a tired nurse|the chef|our manager|
a quiet student|the pilot|her brother|the mayor|a local artist|the engineer|his grandmother|the driver|
a famous singer|the librarian|a small child|the journalist|our landlord|the coach|a retired sailor|
the scientist|my cousin|the baker|a careful lawyer|the gardener|the police officer|a nervous tourist|
the committee""".replace("\n", "").split("|")
VERBS = """repairs|paints|describes|finds|sells|carries|cleans|orders|borrows|watches|photographs|measures|
returns|builds|designs|delivers|inspects|forgets|remembers|moves|opens|checks|loses|buys|studies""".replace("\n", "").split("|")
ADJECTIVES = """wooden|broken|heavy|bright|ancient|small|expensive|red|quiet|strange|modern|dusty|
fragile|enormous|shiny|cheap|rusty|lovely|plain|unusual""".replace("\n", "").split("|")
OBJECTS = """fence|bicycle|window|map|piano|boat|lamp|letter|garden gate|kitchen table|violin|
clock|bridge model|suitcase|painting|telescope|chair|roof|camera|notebook""".replace("\n", "").split("|")
PLACES = """near the river|before dinner|after the storm|in the morning|at the market|behind the school|
on a rainy afternoon|during the holidays|next to the station|in the village|at the harbour|
before the meeting""".replace("\n", "").split("|")

DISTINCT = 10_000


def sentences(n: int = DISTINCT, seed: int = 5) -> list[str]:
    """n distinct sentences, the same for the same (n, seed)."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    out: list[str] = []
    limit = len(SUBJECTS) * len(VERBS) * len(ADJECTIVES) * len(OBJECTS) * len(PLACES)
    if n > limit:
        raise ValueError(f"at most {limit} distinct sentences, asked for {n}")
    while len(out) < n:
        s, v, a, o, p = (rng.integers(len(x)) for x in (SUBJECTS, VERBS, ADJECTIVES, OBJECTS, PLACES))
        text = f"{SUBJECTS[s]} {VERBS[v]} the {ADJECTIVES[a]} {OBJECTS[o]} {PLACES[p]}."
        text = text[0].upper() + text[1:]
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def zipf_ranks(requests: int, distinct: int = DISTINCT, s: float = 1.0, seed: int = 7) -> np.ndarray:
    """``requests`` ranks in [0, distinct), P(k) proportional to 1/(k+1)**s (truncated Zipf)."""
    if requests < 1 or distinct < 1 or s <= 0:
        raise ValueError("requests and distinct must be >= 1 and s > 0")
    weights = 1.0 / np.arange(1, distinct + 1, dtype=np.float64) ** s
    rng = np.random.default_rng(seed)
    return rng.choice(distinct, size=requests, p=weights / weights.sum())


def repeat_fraction(ranks: np.ndarray) -> float:
    """Share of requests whose sentence came earlier in the stream: the hit rate an
    unbounded cache would reach on it."""
    return 1.0 - len(np.unique(ranks)) / len(ranks)
