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

``fit_structure_to_max_tokens`` (:class:`Fitting`): near the end of the budget a sampled token
after which the guide can no longer be closed within ``max_tokens`` is replaced by the first token
of a short closing (:func:`closing`), so the answer ends complete instead of cut.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from contract.errors import InputError

log = logging.getLogger(__name__)

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
        self._closing_tables: ClosingTables | None = None  # fit_structure_to_max_tokens'
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

    def fitting(self, field: str) -> Fitting:
        """A new sequence's fit_structure_to_max_tokens state for a guide of ``field`` (the closing
        search's tables are made on first use)."""
        with self._lock:
            if self._closing_tables is None:
                self._closing_tables = ClosingTables(self.tokenizer, self.vocab_size)
            tables = self._closing_tables
        return Fitting(tables, self.tokenizer.eos_token, json_guide=field == "guided_json")

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


# fit_structure_to_max_tokens. The closing search tries these first, in this order: tokens that close
# strings, arrays and objects (several at once first), separators towards required properties, then
# the smallest values; one model token each where the tokenizer has one. Inside a JSON string only
# the quote-led closers are tried (a bracket there is text), outside none of them (a quote opens);
# for the other guides the closers alone (there "null" may be text, tried again and again).
CLOSERS = ('"]}', '"}]', '"}}', '"}', '"]', '"', "]}", "}]", "}}", "]]", "]", "}", ")")
SEPARATORS = (", ", ",")
SMALLEST = ('""', "[]", "{}", "0", "null", "true", "false", ' ""', " []", " {}")
CLOSING_CAP = 64  # the estimate's search depth while the budget is far
REFRESH = 8  # tokens between two estimates while the budget is far
SLACK = 16  # the budget is near once it is within this many tokens of the estimate
_PUNCTUATION = b"!#$%&'()*+,-./:;<=>?@[]^_`{|}~"  # no quote, no backslash: they open, not close


class ClosingTables:
    """What the closing search needs of a tokenizer (llguidance's), made once per engine: each
    token's bytes, the preferred tokens of the three contexts, the single punctuation bytes."""

    def __init__(self, tokenizer, vocab_size: int):
        import numpy as np

        self.token_bytes = [
            b"" if i >= tokenizer.vocab_size or tokenizer.is_special_token(i) else tokenizer.decode_bytes([i])
            for i in range(vocab_size)
        ]
        # in characters (a token of part of a character: 0) and in bytes
        self.lengths = np.array([_characters(b) for b in self.token_bytes], dtype=np.int32)
        self.nbytes = np.array([len(b) for b in self.token_bytes], dtype=np.int32)
        self.punctuation = np.array([len(b) == 1 and b[0] in _PUNCTUATION for b in self.token_bytes])
        ids: dict[str, int] = {}
        for text in (*CLOSERS, *SEPARATORS, *SMALLEST):
            one = tokenizer.tokenize_str(text)
            if len(one) == 1:
                ids[text] = one[0]
        tail = [ids[t] for t in (*SEPARATORS, *SMALLEST) if t in ids]
        # by context: None (not JSON), True (inside a JSON string), False (outside one)
        self.preferred = {
            None: [ids[t] for t in CLOSERS if t in ids],  # a value's words may be a regex's text: closers only
            True: [ids[t] for t in CLOSERS if t in ids and t.startswith('"')],
            False: [ids[t] for t in CLOSERS if t in ids and not t.startswith('"')] + tail,
        }
        self.tokenizer = tokenizer

    def fallback(self, matcher) -> int | None:
        """A token the guide allows from its mask: a single punctuation byte (a regex's separator),
        else the longest token in characters (a key or a literal in few tokens), else (inside a
        character split over tokens) the longest in bytes."""
        import numpy as np

        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(words, bitorder="little")[: len(self.lengths)].astype(bool)
        allowed &= self.nbytes > 0
        punct = np.flatnonzero(allowed & self.punctuation)
        if punct.size:
            return int(punct[0])
        if not allowed.any():
            return None
        best = int(np.argmax(np.where(allowed, self.lengths, -1)))
        return best if self.lengths[best] > 0 else int(np.argmax(np.where(allowed, self.nbytes, -1)))


def _characters(data: bytes) -> int:
    try:
        return len(data.decode("utf-8"))
    except UnicodeDecodeError:
        return 0


def quoted_after(quoted: tuple[bool, bool], data: bytes) -> tuple[bool, bool]:
    """(inside a JSON string, after its backslash) once ``data`` follows."""
    inside, escaped = quoted
    for b in data:
        if escaped:
            escaped = False
        elif inside and b == 0x5C:
            escaped = True
        elif b == 0x22:
            inside = not inside
    return inside, escaped


def closing(matcher, limit: int, tables: ClosingTables, quoted: tuple[bool, bool] | None) -> list[int] | None:
    """A short closing of the guide from ``matcher``'s state: the tokens that bring it to a complete
    answer (empty when it is complete already), or None when none of at most ``limit`` tokens was
    found. ``quoted``: where a JSON guide stands (quoted_after), None for the other guides.
    ``matcher`` is not moved (the search runs on a copy).

    Greedy, one token at a time: the tokens the guide forces (llguidance's fast-forward, or its
    forced bytes as tokens), else the first preferred token the guide accepts, else the fallback."""
    if matcher.is_accepting():
        return []
    m = matcher.deep_copy()
    path: list[int] = []
    while len(path) < limit:
        step = m.compute_ff_tokens()
        if not step:
            forced = m.compute_ff_bytes()
            step = tables.tokenizer.tokenize_bytes(forced)[:1] if forced else []
            if step and m.try_consume_tokens(step) != 1:
                step = []
        else:
            m.consume_tokens(step)
        if not step:
            preferred = tables.preferred[None if quoted is None else quoted[0]]
            token = next((t for t in preferred if m.try_consume_tokens([t]) == 1), None)
            if token is None:
                token = tables.fallback(m)
                if token is None or not m.consume_token(token):
                    return None
            step = [token]
        if len(step) > limit - len(path):
            return None
        path += step
        if quoted is not None:
            quoted = quoted_after(quoted, b"".join(tables.token_bytes[t] for t in step))
        if m.is_accepting():
            return path
    return None


class Fitting:
    """One guided sequence's ``fit_structure_to_max_tokens``: once the budget left nears the
    tokens needed to close the guide, each sampled token is kept only if a closing still fits after
    it; otherwise the closing's first token replaces it (the sequence is ``fitted``). When even the
    closing does not fit, the sequence runs as without the option (``off``)."""

    def __init__(self, tables: ClosingTables, eos: int, json_guide: bool):
        self.tables = tables
        self.eos = eos
        self.quoted: tuple[bool, bool] | None = (False, False) if json_guide else None
        self.path: list[int] | None = None  # the closing from the matcher's state, while near
        self.estimate = 0  # the closing's length when last searched
        self.fitted = False
        self.off = False

    def seen(self, token: int) -> None:
        """The matcher consumed ``token``."""
        if self.quoted is not None:
            self.quoted = quoted_after(self.quoted, self.tables.token_bytes[token])

    def _closing(self, matcher, limit: int) -> list[int] | None:
        return closing(matcher, limit, self.tables, self.quoted)

    def take(self, matcher, token: int, generated: int, max_tokens: int) -> int:
        """Consume the sampled ``token`` (``generated`` tokens come before it) into ``matcher``, or
        the closing's first token in its place; returns the token kept."""
        left = max_tokens - generated  # this token included
        if not self.off and self.path is None and (generated % REFRESH == 0 or left <= self.estimate + SLACK):
            near = left <= self.estimate + SLACK
            found = self._closing(matcher, left if near else min(left, CLOSING_CAP))
            self.estimate = CLOSING_CAP if found is None else len(found)
            if near or left <= self.estimate + SLACK:
                self.path = found
                self.off = found is None or len(found) > left  # no closing fits: as without the option
        if not matcher.consume_token(token):
            log.warning("structured output: the guide refused sampled token %d (%s)", token, matcher.get_error())
            return token
        path = self.path
        if path is None or self.off:
            self.seen(token)
            return token
        before = self.quoted
        self.seen(token)
        rest = path[1:] if path and token == path[0] else self._closing(matcher, left - 1)
        if rest is not None:
            self.path = rest
            return token
        matcher.rollback(1)
        self.quoted = before
        token = path[0] if path else self.eos  # complete, no room for more: it ends here
        matcher.consume_token(token)
        self.seen(token)
        self.path = path[1:]
        self.fitted = True
        return token
