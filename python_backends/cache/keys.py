"""Cache keys: a hash of what computed the vector and of the exact text.

A key is ``emb2:`` + SHA-256 over, each length-prefixed: the model the misses go to
(``text_embedding``), the encoder (``text_encoder``), the encoder version that serves, its
precision variant (``int8``, ``fp32``, ...), a fingerprint of the served model file, and the
text's exact UTF-8 bytes (a vector of the text truncated at the left, its last tokens, has the
tag ``truncation=left`` hashed before the text and the prefix ``emb2:left:``). No normalisation:
"Hello", "hello" and "Hello " are three keys, because the tokenizer (lower-casing, whitespace splitting) belongs to the model, and a cache
that folded texts together would serve a vector the model might not produce for them.
Length prefixes make field boundaries unambiguous ("ab"+"c" never equals "a"+"bc").

A new version, variant or re-exported file therefore changes every key: entries written
before a hot swap can no longer be found (they age out by TTL and LRU), so none is served.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# Bump when the key recipe or the stored value layout changes: old entries become unreachable.
KEY_PREFIX = "emb2:"
# Hashed before the text in the key of a left-truncated vector (docs/embeddings.md#truncation).
LEFT_TAG = b"truncation=left"


@dataclass(frozen=True)
class ModelIdentity:
    """Everything that decides which vector a text gets."""

    model: str  # where misses are computed (the ensemble)
    encoder: str  # the model whose version and variant make the vectors
    version: str
    variant: str
    fingerprint: str = ""  # SHA-256 prefix of the served model file ("" when unknown)

    def describe(self) -> str:
        fp = f" file {self.fingerprint}" if self.fingerprint else ""
        return f"{self.model} ({self.encoder} version {self.version}, variant {self.variant}{fp})"


def _field(h: hashlib._Hash, value: bytes, width: int = 4) -> None:
    h.update(len(value).to_bytes(width, "little"))
    h.update(value)


class KeyMaker:
    """Keys for one identity; the identity's part of the hash is computed once."""

    def __init__(self, identity: ModelIdentity):
        self.identity = identity
        base = hashlib.sha256(b"text-embedding-cache/1")
        for part in (identity.model, identity.encoder, identity.version, identity.variant, identity.fingerprint):
            _field(base, part.encode("utf-8"))
        self._base = base

    def __call__(self, text: str, left: bool = False) -> str:
        """The key of ``text``'s vector; ``left``: of its vector truncated at the left (its last
        tokens), which differs from the right-truncated one for a text over the limit. A text
        that fits has one vector whichever way it may be truncated, and right truncation keeps
        what the keys always held, so only left gets a tag of its own."""
        h = self._base.copy()
        if left:
            _field(h, LEFT_TAG)
        _field(h, text.encode("utf-8"), 8)
        return (KEY_PREFIX + "left:" if left else KEY_PREFIX) + h.hexdigest()
