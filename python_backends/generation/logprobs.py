"""Log-probabilities of generated tokens: computed from the step's logits, handed out in step
with the text, and written as OpenAI's objects.

``compute`` takes the logits rows of the sequences that asked (``SamplingParams.logprobs``
set) and the tokens the sampler chose: the chosen token's log-probability under the model's
own distribution (log-softmax of the raw logits, before temperature, penalties or filters, as
vLLM reports them by default) and the ``k`` most likely tokens at that position. Rows that did
not ask cost nothing.

``Aligner`` holds a request's entries until the text that holds their tokens has been sent:
the detokenizer holds text back (an incomplete UTF-8 character, a possible stop string), and an
entry is released when the UTF-8 bytes of the text sent so far cover its token's bytes, so the
``token`` fields of the entries a response carries add up to the text sent with it (special
tokens, which the text leaves out, count as empty).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id and log-probability, and the most likely ids at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def compute(logits: torch.Tensor, tokens: Sequence[int], top_k: Sequence[int]) -> list[TokenLogprob]:
    """``logits`` [n, vocab] (raw), the token chosen at each row and how many alternatives it
    wants (``SamplingParams.logprobs``): one TokenLogprob per row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.as_tensor(list(tokens), dtype=torch.long, device=logp.device)[:, None])[:, 0].tolist()
    k = max(top_k, default=0)
    if k:
        values, ids = logp.topk(k, dim=-1)
        values_l, ids_l = values.tolist(), ids.tolist()
    out = []
    for row, (token, lp, want) in enumerate(zip(tokens, chosen, top_k)):
        top = tuple(zip(ids_l[row][:want], values_l[row][:want])) if want else ()
        out.append(TokenLogprob(int(token), float(lp), top))
    return out


class TokenBytes:
    """The UTF-8 bytes each token id stands for in the decoded text (b"" for the special tokens
    the text skips), cached per id."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._cache: dict[int, bytes] = {}
        self._byte_decoder = _byte_level_decoder(tokenizer)

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._bytes(token_id)
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._special:
            return b""
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and self._byte_decoder and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        return self._tokenizer.decode([token_id]).encode("utf-8")


def _byte_level_decoder(tokenizer) -> dict[str, int] | None:
    """GPT-2's byte-to-unicode table, inverted, when the tokenizer is byte-level BPE."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or "ByteLevel" not in type(backend.decoder).__name__:
        return None
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = visible[:]
    extra = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, codes)}


class Aligner:
    """One request's entries, released as the text that holds their tokens is sent."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._bytes = token_bytes
        self.entries: list[TokenLogprob] = []
        self._released = 0
        self._covered = 0  # bytes of the released entries' tokens
        self._sent = 0  # UTF-8 bytes of the text sent so far

    def add(self, entries: Sequence[TokenLogprob]) -> None:
        self.entries.extend(entries)

    def release(self, text: str, kept: int) -> list[TokenLogprob]:
        """The entries whose tokens the text sent so far (now ``text`` more) covers, among the
        first ``kept`` (the tokens the sequence holds)."""
        self._sent += len(text.encode("utf-8"))
        start = self._released
        while self._released < min(kept, len(self.entries)):
            size = len(self._bytes(self.entries[self._released].token_id))
            if self._covered + size > self._sent:
                break
            self._covered += size
            self._released += 1
        return self.entries[start : self._released]

    def finish(self, kept: int) -> list[TokenLogprob]:
        """The rest of the entries of the first ``kept`` tokens (those the sequence kept: what
        follows a stop string is dropped)."""
        start = self._released
        self._released = max(start, min(kept, len(self.entries)))
        return self.entries[start : self._released]


def openai_content(entries: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes]) -> list[dict]:
    """OpenAI's chat ``logprobs.content``: token, logprob, bytes and top_logprobs of each."""

    def one(token_id: int, logprob: float) -> dict:
        raw = token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def prompt_content(entries: Sequence[TokenLogprob | None], token_bytes: Callable[[int], bytes]) -> list[dict | None]:
    """A prompt's entries as :func:`openai_content` writes them; None (the first token's) as null."""
    return [None if e is None else openai_content([e], token_bytes)[0] for e in entries]
