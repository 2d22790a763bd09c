"""Structured outputs: a request's guide (a JSON schema, a regex, a list of choices or a Lark
grammar) enforced token by token with llguidance.

A guide comes in as vLLM's sampling fields (``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``) and is checked for form by ``SamplingParams``. Here it
is compiled once per distinct guide (cached by its SHA-256) and validated against the model's
tokenizer, on the thread that submits the request, never on the engine's loop: a bad guide is
an InputError naming its field, llguidance's parser limits bound the work of a hostile one.
Each sequence then holds its own matcher: before a step samples, the matcher's mask of the
tokens the guide allows next is applied to the row (the others go to -inf), and the token the
sampler chose is consumed. When the guide is complete the mask allows EOS alone, so the
sequence ends there.

The matcher lives as long as the request and only moves forward: a preempted sequence keeps its
generated tokens (it is recomputed, not resampled), so nothing has to be replayed.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from contract.errors import InputError

CACHED_GRAMMARS = 256
# JSON on one line with ", " and ": ": llguidance's default allows any run of whitespace between
# tokens, where a small model can loop until max_tokens cuts the answer.
JSON_LAYOUT: Any = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}  # llguidance's JsonCompileOptions


def _grammar(field: str, source: str) -> str:
    import llguidance

    matcher = llguidance.LLMatcher
    if field == "guided_json":
        return matcher.grammar_from_json_schema(source, defaults=JSON_LAYOUT)
    if field == "guided_regex":
        return matcher.grammar_from_regex(source)
    if field == "guided_choice":
        choices = json.loads(source)
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    return matcher.grammar_from_lark(source)


class Grammars:
    """Compiled guides of one engine's tokenizer, cached; a matcher per sequence."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance  # imported here: the clients and the gateway import this module's checks
        import llguidance.hf

        self._llguidance = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # guides compiled (cache misses), for tests and metrics

    def compile(self, field: str, source: str) -> str:
        """The validated grammar of a guide (compiled once, then from the cache); InputError
        naming ``field`` with llguidance's message for a guide it cannot compile."""
        key = hashlib.sha256(f"{field}\0{source}".encode()).hexdigest()
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        try:
            grammar = _grammar(field, source)
        except ValueError as exc:
            raise InputError(field, f"cannot be compiled: {exc}") from None
        error = self._llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InputError(field, f"cannot be compiled: {error.strip()[:500]}")
        with self._lock:
            self._cache[key] = grammar
            self.compiled += 1
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, field: str, source: str):
        """A new matcher at the start of the guide."""
        return self._llguidance.LLMatcher(self.tokenizer, self.compile(field, source), log_level=0)

    def allowed(self, matchers: list):
        """[len(matchers), vocab] bool tensor: the tokens each matcher allows next (llguidance's
        bitmask, bit i % 32 of word i // 32, unpacked; its own apply function is slow on CPU)."""
        import torch

        # Filled in place by the matcher (what llguidance.torch.fill_next_token_bitmask does; that
        # module is not imported: it sets up torch.compile, which the model's stub cannot afford).
        bitmask = torch.zeros((len(matchers), self.words), dtype=torch.int32)
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), self.words * 4)
        bits = torch.arange(32, dtype=torch.int32)
        return ((bitmask[:, :, None] >> bits) & 1).bool().reshape(len(matchers), -1)[:, : self.vocab_size]
