"""Prompt-lookup (n-gram) drafts for speculative decoding: no draft model, only the sequence.

A greedy sequence that repeats itself or quotes its prompt (code edits, summaries, extraction,
lists) writes, token for token, what already stands earlier in its context. The proposer finds
the most recent earlier occurrence of the sequence's last ``n`` tokens (the longest ``n`` from
``max_n`` down to ``min_n`` that occurs) and proposes the tokens that followed it. The engine runs
the last sampled token and the draft as one chunk of the step, samples every row, and keeps the
draft up to the first token where the model's own choice differs, plus that choice: the output is
the tokens greedy decoding would give, and each step that accepts ``a`` draft tokens emits
``a + 1`` tokens for the price of one step (a step of a few rows costs what one row costs while
the weights' bytes dominate, ``linear.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# n-gram sizes tried, longest first (vLLM's prompt_lookup_min / prompt_lookup_max). One token
# alone matches too often to predict anything.
MIN_NGRAM = 2
MAX_NGRAM = 4
# How far back the search looks: enough for a long prompt, bounded so a step stays cheap.
MAX_LOOKBACK = 4096


def propose_ngram(
    tokens: Sequence[int], num_draft: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM, lookback: int = MAX_LOOKBACK
) -> list[int]:
    """Up to ``num_draft`` tokens that followed the latest earlier occurrence of the last n-gram.

    Returns ``[]`` when no n-gram of ``min_n..max_n`` tokens at the end of ``tokens`` occurred
    before (or ``num_draft`` is 0).
    """
    if num_draft <= 0 or len(tokens) <= min_n:
        return []
    arr = np.asarray(tokens[-lookback:], dtype=np.int64)
    size = arr.size
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = arr[size - n :]
        # Candidate starts: an earlier window whose tokens equal the suffix's, with at least
        # one token after it (the window ending at the sequence's end is the suffix itself).
        starts = np.flatnonzero(arr[: size - n] == suffix[0])
        if starts.size == 0:
            continue
        match = np.ones(starts.size, dtype=bool)
        for j in range(1, n):
            match &= arr[starts + j] == suffix[j]
        hits = starts[match]
        if hits.size:
            follow = int(hits[-1]) + n
            return arr[follow : follow + num_draft].tolist()
    return []


def accept_draft(draft: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verified draft yields: ``sampled[j]`` is the model's token after the last
    sampled token and ``draft[:j]``. The draft holds up to its first token that differs from the
    model's; the model's token there (or after the whole draft) comes last."""
    if len(sampled) != len(draft) + 1:
        raise ValueError(f"{len(sampled)} sampled tokens for a draft of {len(draft)}: need one more")
    out: list[int] = []
    for j, token in enumerate(sampled):
        out.append(int(token))
        if j == len(draft) or int(token) != int(draft[j]):
            break
    return out
