"""Pair tokenization for the cross-encoder reranker: one query, many documents -> one row per pair.

Each row is ``[CLS] query [SEP] document [SEP]`` as the checkpoint's own tokenizer.json lays a
pair out (its post-processor), with ``token_type_ids`` 0 for the query part and 1 for the
document part. All pairs of a request are tokenized in one call and padded to the smallest
sequence bucket that holds the longest, so the encoder's batcher can merge requests of equal
width.

Length: a pair longer than ``max_length`` (the checkpoint's position limit, or less) is
refused by default, naming the document, its token count and the limit, as the embedding path
refuses what it would otherwise cut silently. ``truncation="document"`` instead cuts the end
of each long document, keeping the whole query; a query that leaves no room for any document
token is refused either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.errors import TOO_LARGE, ConfigError, InputError
from contract.model_config import bucket_length
from python_backends.text.tokenization import load_tokenizer

TRUNCATION = ("refuse", "document")
DEFAULT_PAIR_BUCKETS = (32, 64, 128, 256, 512)


@dataclass(frozen=True)
class EncodedPairs:
    input_ids: np.ndarray  # [n, L] int64
    attention_mask: np.ndarray  # [n, L] int64
    token_type_ids: np.ndarray  # [n, L] int64
    num_tokens: np.ndarray  # [n] int32 tokens of each whole pair (special tokens included, before any cut)


class PairTokenizer:
    """A fast (Rust) tokenizer laying out (query, document) pairs with explicit length rules."""

    def __init__(
        self,
        tokenizer_file: str | Path,
        max_length: int,
        buckets: Iterable[int] = DEFAULT_PAIR_BUCKETS,
        truncation: str = "refuse",
    ):
        if truncation not in TRUNCATION:
            raise ConfigError(f"truncation must be one of {', '.join(TRUNCATION)}; got {truncation!r}")
        path = Path(tokenizer_file)
        # Length is decided here (refuse or cut the document), never by the file's own settings.
        self._tok, self.buckets, self.pad_id = load_tokenizer(path, max_length, buckets, "export a cross-encoder: docs/export.md")
        self.max_length = max_length
        self.truncation = truncation
        probe = self._tok.encode("a", "b", add_special_tokens=True)
        if 1 not in probe.type_ids:
            raise ConfigError(
                f"{path.name}: its post-processor gives no segment B (type id 1) to a pair; not a BERT pair tokenizer"
            )
        # Special tokens after the document ([SEP]): kept when a document is cut.
        specials = probe.special_tokens_mask
        self._tail = 0
        while self._tail < len(specials) and specials[len(specials) - 1 - self._tail]:
            self._tail += 1

    def _query_part(self, encoding) -> int:
        """Tokens before the document: leading specials, the query, the separator(s)."""
        return encoding.type_ids.index(1) if 1 in encoding.type_ids else len(encoding.ids)

    def encode(
        self, query: str, documents: Sequence[str], query_field: str = "QUERY", documents_field: str = "DOCUMENTS"
    ) -> EncodedPairs:
        """Rows for (query, documents[i]); InputError naming the field for a pair that does not fit."""
        assert documents, "the caller refuses a request without documents"
        encodings = self._tok.encode_batch_fast([(query, d) for d in documents], add_special_tokens=True)
        counts = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        head = self._query_part(encodings[0])
        if head + self._tail + 1 > self.max_length:
            raise InputError(
                query_field,
                f"the query takes {head} tokens with its special tokens; with a document it cannot fit the "
                f"model's {self.max_length}-token limit",
                code=TOO_LARGE,
                values={"tokens": head, "limit": self.max_length},
            )
        if self.truncation == "refuse":
            over = np.flatnonzero(counts > self.max_length)
            if over.size:
                i = int(over[0])
                raise InputError(
                    f"{documents_field}[{i}]",
                    f"query and document together are {int(counts[i])} tokens; the model's limit is "
                    f'{self.max_length} (shorten the document, or serve with truncation "document")',
                    code=TOO_LARGE,
                    values={"tokens": int(counts[i]), "limit": self.max_length, "documents_over_limit": int(over.size)},
                )
        lengths = np.minimum(counts, self.max_length)
        width = bucket_length(int(lengths.max()), self.buckets)
        ids = np.full((len(encodings), width), self.pad_id, dtype=np.int64)
        types = np.zeros((len(encodings), width), dtype=np.int64)
        keep, tail = self.max_length - self._tail, self._tail
        for row, e in enumerate(encodings):
            seq, seg = e.ids, e.type_ids
            if len(seq) > self.max_length:  # the document's first tokens, then the closing specials
                seq = seq[:keep] + (seq[len(seq) - tail :] if tail else [])
                seg = seg[:keep] + (seg[len(seg) - tail :] if tail else [])
            ids[row, : len(seq)] = seq
            types[row, : len(seg)] = seg
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        return EncodedPairs(ids, mask, types, counts.astype(np.int32))
