"""Batch tokenization for the text-embedding ensemble.

One tokenizer call per Triton batch (all texts of all requests together); a text over the
model's maximum length is refused, or truncated at either end, as each text's request chose
(contract/truncation.py); padding to the batch's longest sequence rounded up to a
bucket. Each text's token count before truncation comes back too (``num_tokens``): it is what
OpenAI's ``usage`` reports and what the refusal names, so nobody has to tokenize the text a
second time.
Bucketing matters downstream: Triton's dynamic batcher only merges requests whose
non-batch shapes are equal, so a handful of fixed lengths lets encoder batches form
across tokenizer batches, while padding to the longest (not to 256) keeps short texts cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.errors import ConfigError, InputError
from contract.model_config import bucket_length
from contract.truncation import REFUSE, Truncation, refuse_over_limit

DEFAULT_BUCKETS = (16, 32, 64, 128, 256)

log = logging.getLogger(__name__)


def decode_texts(values: np.ndarray, field: str, max_bytes: int) -> list[str]:
    """Turn one request's TEXT tensor (numpy object array of bytes) into validated strings.

    Raises InputError naming the element and the rule it breaks: empty, whitespace only,
    not UTF-8, or above ``max_bytes``.
    """
    texts = []
    for index, value in enumerate(np.asarray(values, dtype=object).reshape(-1)):
        name = f"{field}[{index}]"
        if isinstance(value, str):
            raw = value.encode("utf-8")
        elif isinstance(value, (bytes, bytearray, np.bytes_)):
            raw = bytes(value)
        else:
            raise InputError(name, f"expected a UTF-8 string, got {type(value).__name__}")
        if len(raw) > max_bytes:
            raise InputError(name, f"text is {len(raw)} bytes; the limit is {max_bytes} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(name, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
        if not text:
            raise InputError(name, "text is empty")
        if not text.strip():
            raise InputError(name, "text contains only whitespace")
        texts.append(text)
    return texts


def load_tokenizer(path: str | Path, max_length: int, buckets: Iterable[int], missing: str) -> tuple:
    """A tokenizer file with its own truncation and padding off (length is decided by the caller),
    the sorted sequence buckets (the largest must be ``max_length``) and the padding id.
    ``missing``: what to say when the file is not there."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tokenizer file not found: {path} ({missing})")
    sorted_buckets = sorted(set(int(b) for b in buckets))
    if not sorted_buckets or sorted_buckets[0] < 1:
        raise ConfigError(f"sequence buckets must be positive integers, got {sorted_buckets}")
    if sorted_buckets[-1] != max_length:
        raise ConfigError(f"the largest sequence bucket ({sorted_buckets[-1]}) must equal max_sequence_length ({max_length})")
    tok = Tokenizer.from_file(str(path))
    tok.no_truncation()
    tok.no_padding()
    pad_id = tok.token_to_id("[PAD]")
    return tok, sorted_buckets, 0 if pad_id is None else pad_id


@dataclass(frozen=True)
class EncodedBatch:
    input_ids: np.ndarray  # [n, L] int64
    attention_mask: np.ndarray  # [n, L] int64
    lengths: np.ndarray  # [n] int64 tokens the model sees (with special tokens, after truncation)
    num_tokens: np.ndarray  # [n] int32 tokens of the whole text (with special tokens, before truncation)

    def __getitem__(self, span: slice) -> EncodedBatch:
        """The rows of ``span``, keeping the batch's padded length."""
        return EncodedBatch(self.input_ids[span], self.attention_mask[span], self.lengths[span], self.num_tokens[span])


class BatchTokenizer:
    """A fast (Rust) tokenizer configured for fixed truncation and bucketed padding."""

    def __init__(self, tokenizer_file: str | Path, max_length: int, buckets: Iterable[int] = DEFAULT_BUCKETS):
        # tokenizer.json ships its own truncation/padding (128, fixed), turned off: the whole text
        # is tokenized (the tokenizers library does so even when it truncates), so its count is
        # known; truncation and padding are done here, as the library would do them.
        self._tok, self.buckets, self.pad_id = load_tokenizer(tokenizer_file, max_length, buckets, "run `make export`")
        self.max_length = max_length
        # Truncation keeps the post-processor's special tokens at both ends ([CLS] ... [SEP]).
        self._lead = self._leading_specials() if self._tok.post_processor else 0
        self._tail = self._tok.post_processor.num_special_tokens_to_add(False) - self._lead if self._tok.post_processor else 0
        if max_length <= self._lead + self._tail:
            raise ConfigError(f"max_sequence_length {max_length} leaves no room for text beside the special tokens")

    def _leading_specials(self) -> int:
        mask = self._tok.encode("a", add_special_tokens=True).special_tokens_mask
        lead = 0
        while lead < len(mask) and mask[lead]:
            lead += 1
        return lead

    def encode(self, texts: Sequence[str], left: Sequence[bool] | None = None) -> EncodedBatch:
        """Ids and mask of ``texts``; one over ``max_length`` keeps its first tokens, or its last
        ones where ``left[i]``, the special tokens staying at both ends. Refusing is the caller's
        choice (encode_requests)."""
        if not texts:
            empty = np.zeros((0, self.buckets[0]), dtype=np.int64)
            return EncodedBatch(empty, empty.copy(), np.zeros((0,), dtype=np.int64), np.zeros((0,), dtype=np.int32))
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=True)
        counts = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        lengths = np.minimum(counts, self.max_length)
        width = bucket_length(int(lengths.max()), self.buckets)
        ids = np.full((len(encodings), width), self.pad_id, dtype=np.int64)
        keep, lead, tail = self.max_length - self._tail, self._lead, self._tail
        for row, e in enumerate(encodings):
            seq = e.ids
            if len(seq) > self.max_length:
                if left is not None and left[row]:  # the opening specials, then the text's last tokens
                    seq = seq[:lead] + seq[len(seq) - (self.max_length - lead) :]
                else:  # the text's first tokens, then the closing specials
                    seq = seq[:keep] + (seq[len(seq) - tail :] if tail else [])
            ids[row, : len(seq)] = seq
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        return EncodedBatch(ids, mask, lengths, counts.astype(np.int32))

    def encode_requests(
        self, texts: Sequence[str], spans: Sequence[tuple[int, int]], options: Sequence[Truncation] | None = None
    ) -> list:
        """``encode_isolated`` with this tokenizer, each text truncated as ``options[i]`` says
        (default: none may be; contract.truncation). A request with a text over
        ``max_length`` that may not be truncated gets a ContextLengthError (its first such
        text, index within the request); the other requests of the batch are unaffected."""
        options = list(options) if options is not None else [REFUSE] * len(texts)
        left = [o.left for o in options]
        out = encode_isolated(self.encode, texts, spans, left)
        for k, ((a, b), got) in enumerate(zip(spans, out)):
            if isinstance(got, EncodedBatch):
                refused = refuse_over_limit(got.num_tokens, options[a:b], self.max_length)
                if refused is not None:
                    out[k] = refused
        return out


def encode_isolated(
    encode: Callable[..., EncodedBatch],
    texts: Sequence[str],
    spans: Sequence[tuple[int, int]],
    left: Sequence[bool] | None = None,
) -> list:
    """One ``encode`` call for all of a batch's texts (and their ``left`` flags, when given),
    sliced per request: ``spans[k] = (start, stop)`` into ``texts``. If that call raises, each
    request's texts are encoded alone, so an unexpected tokenizer failure on one text fails only
    the request that sent it (each retried request is then padded to its own bucket). Returns,
    per span, its EncodedBatch or the exception that request raised."""

    def call(a: int, b: int) -> EncodedBatch:
        return encode(texts[a:b]) if left is None else encode(texts[a:b], left[a:b])

    try:
        batch = call(0, len(texts))
    except Exception as exc:  # noqa: BLE001 - isolate it to the request that caused it
        if len(spans) <= 1:
            return [exc for _ in spans]
        log.warning("tokenizing a batch of %d requests failed (%s); retrying one by one", len(spans), exc)
    else:
        return [batch[a:b] for a, b in spans]
    out: list = []
    for a, b in spans:
        try:
            out.append(call(a, b))
        except Exception as exc:  # noqa: BLE001
            out.append(exc)
    return out
