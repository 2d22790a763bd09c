"""Truncation as the caller chooses it (TEI's ``truncate`` and ``truncation_direction``).

The default is to refuse: a text with more tokens than the model takes is an error naming the
text, its token count and the limit, so nothing is lost silently (TEI and OpenAI do the same).
``truncate`` keeps ``max_sequence_length`` tokens: the first ones (``right``, the default) or
the last ones (``left``); the special tokens ([CLS] ... [SEP]) stay at both ends, only the
text's own tokens are cut. Token counts always report the whole text (before truncation).

Each value is checked here, once, where it enters (the tokenizer step, the cached entry, the
gateway); inside, code trusts a ``Truncation``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from contract.errors import CONTEXT_LENGTH, InputError

RIGHT, LEFT = "right", "left"
DIRECTIONS = (RIGHT, LEFT)
# The optional inputs of the text entry points and of text_tokenizer.
TRUNCATE_INPUT, DIRECTION_INPUT = "TRUNCATE", "TRUNCATION_DIRECTION"


@dataclass(frozen=True)
class Truncation:
    """One text's choice: refuse (``truncate`` False) or keep the ``direction``'s end."""

    truncate: bool = False
    direction: str = RIGHT

    @property
    def left(self) -> bool:
        return self.truncate and self.direction == LEFT


REFUSE = Truncation()


def parse_direction(value: Any, field: str) -> str:
    """``right`` or ``left`` from a string or UTF-8 bytes, any case (TEI sends ``Right``);
    InputError naming ``field`` and the allowed values otherwise."""
    text: str | None = None
    if isinstance(value, str):
        text = value
    elif isinstance(value, (bytes, bytearray, np.bytes_)):
        try:
            text = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            text = None
    direction = text.strip().lower() if text is not None else None
    if direction not in DIRECTIONS:
        shown = repr(text[:40]) if text is not None else type(value).__name__
        raise InputError(
            field, f"must be one of {', '.join(DIRECTIONS)}, got {shown}", values={"allowed": list(DIRECTIONS), "got": shown}
        )
    return direction


def parse_truncation(
    truncate: np.ndarray | None, direction: np.ndarray | None, rows: int, default: bool = False
) -> list[Truncation]:
    """Each row's Truncation from a request's optional TRUNCATE (bool [rows, 1]) and
    TRUNCATION_DIRECTION (string [rows, 1]) arrays; absent ones take the defaults (``default``,
    the model's ``truncate`` parameter: refuse unless set; right)."""
    flags: Sequence[Any] = [default] * rows
    ways: Sequence[str] = [RIGHT] * rows
    if truncate is not None:
        values = np.asarray(truncate).reshape(-1)
        if len(values) != rows:
            raise InputError(TRUNCATE_INPUT, f"has {len(values)} values for {rows} texts; send one per text")
        if values.dtype != np.bool_:
            raise InputError(TRUNCATE_INPUT, f"must be BOOL, got {values.dtype}")
        flags = [bool(v) for v in values]
    if direction is not None:
        values = np.asarray(direction, dtype=object).reshape(-1)
        if len(values) != rows:
            raise InputError(DIRECTION_INPUT, f"has {len(values)} values for {rows} texts; send one per text")
        ways = [parse_direction(v, f"{DIRECTION_INPUT}[{i}]") for i, v in enumerate(values)]
    return [Truncation(bool(f), w) for f, w in zip(flags, ways)]


class ContextLengthError(InputError):
    """A text over the model's limit while truncation was not asked for (INVALID_ARG / 400
    ``context_length_exceeded``); ``values``: the text's ``index`` in its request, its ``tokens``
    and the ``limit``."""

    code = CONTEXT_LENGTH

    def __init__(self, field: str, index: int, tokens: int, limit: int):
        super().__init__(
            f"{field}[{index}]",
            f"text has {tokens} tokens; the model's limit is {limit} tokens (max_sequence_length). "
            f"Shorten or split it, or send {TRUNCATE_INPUT}=true to embed its first {limit} tokens "
            f"({DIRECTION_INPUT}=left: its last {limit})",
            values={"index": index, "tokens": tokens, "limit": limit},
        )


def refuse_over_limit(
    counts: Sequence[int] | np.ndarray, options: Sequence[Truncation], limit: int, field: str = "TEXT"
) -> ContextLengthError | None:
    """The error for the first text of one request over ``limit`` that may not be truncated
    (None when every text fits or may be truncated)."""
    for i, (n, option) in enumerate(zip(counts, options)):
        if int(n) > limit and not option.truncate:
            return ContextLengthError(field, i, int(n), limit)
    return None
