"""Incremental detokenization with stop strings, one sequence at a time.

Streaming needs the text each new token adds, but a byte-level BPE token can end in the
middle of a UTF-8 character (an emoji is often three or four tokens), and decoding one
token alone loses the context some decoders need. The usual remedy (vLLM, TGI) decodes a
short window ``ids[prefix_offset:]`` and compares it with ``ids[prefix_offset:read_offset]``;
the difference is the new text, held back while it ends in U+FFFD (an incomplete
character). The window slides forward, so each step costs a few tokens, not the sequence.

Stop strings are matched on the decoded text: text that could still become a stop string
is held back, and the output is cut before the first complete one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"
# Tokens of context kept before the new ones when the prompt seeds the window (vLLM's 5):
# enough for decoders that treat the first token of a decode specially.
_CONTEXT_TOKENS = 5


def detokenize_incrementally(
    tokenizer,
    token_ids: Sequence[int],
    prefix_offset: int,
    read_offset: int,
    skip_special_tokens: bool = True,
) -> tuple[str, int, int]:
    """New text of ``token_ids`` since ``read_offset``, and the offsets for the next call.

    Returns ``("", prefix_offset, read_offset)`` while the new tokens end mid-character.
    """
    prefix_text = tokenizer.decode(list(token_ids[prefix_offset:read_offset]), skip_special_tokens=skip_special_tokens)
    new_text = tokenizer.decode(list(token_ids[prefix_offset:]), skip_special_tokens=skip_special_tokens)
    if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
        return new_text[len(prefix_text) :], read_offset, len(token_ids)
    return "", prefix_offset, read_offset


@dataclass
class DetokenizerOutput:
    """What one step adds to the stream: ``text`` may be empty; ``finish_reason`` is
    ``"stop"`` once a stop string was found (the engine then finishes the sequence)."""

    text: str
    finish_reason: str | None = None


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into safe text pieces.

    ``step(output_ids)`` takes all generated ids so far (the engine's list) and returns the
    piece to stream now; no piece before :meth:`finish` ends mid-character or holds part
    of a stop string. The stop string itself is not part of the output unless ``include_stop``
    (vLLM's ``include_stop_str_in_output``).
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop  # the stop string ends the output instead of being cut off
        self.stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        # The prompt's last tokens are context only: decoding starts after them.
        self._prompt = list(prompt_ids[-_CONTEXT_TOKENS:]) if len(prompt_ids) else []
        self._prefix_offset = 0
        self._read_offset = len(self._prompt)
        self._seen = 0
        self._ids = list(self._prompt)  # context tokens, then every output id seen
        self.text = ""  # every decoded character of the output so far, stop or not
        self.emitted = 0  # how much of ``text`` has been streamed
        self.finish_reason: str | None = None
        self.finished = False

    @property
    def output_text(self) -> str:
        """What has been streamed so far."""
        return self.text[: self.emitted]

    def _held_for_stop(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string.

        Only tails that start with a stop string's first character are tried, so the
        per-step cost stays small with many long stop strings.
        """
        longest = 0
        for s in self.stop:
            if len(s) < 2:
                continue
            tail = self.text[-(len(s) - 1) :]
            i = tail.find(s[0])
            while i != -1 and len(tail) - i > longest:
                if s.startswith(tail[i:]):
                    longest = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return longest

    def step(self, output_ids: Sequence[int]) -> DetokenizerOutput:
        """The text piece the newest ids in ``output_ids`` (all generated ids) add.

        The list only grows: ids already passed are not looked at again (a preempted
        sequence that is recomputed keeps its output ids, and its detokenizer).
        """
        if self.finished:
            return DetokenizerOutput("", self.finish_reason)
        if len(output_ids) < self._seen:
            raise ValueError(f"output ids shrank from {self._seen} to {len(output_ids)}")
        self._ids.extend(output_ids[self._seen :])
        ids = self._ids
        before = len(self.text)
        piece, self._prefix_offset, self._read_offset = detokenize_incrementally(
            self.tokenizer, ids, self._prefix_offset, self._read_offset, self.skip_special_tokens
        )
        self.text += piece
        self._seen = len(output_ids)
        return self._release(before, final=False)

    def finish(self) -> DetokenizerOutput:
        """Flush at the end of the sequence (EOS, length, cancellation): the held-back text.

        A sequence cut mid-character ends in U+FFFD here, as a full decode would. Later
        calls return nothing.
        """
        if self.finished:
            return DetokenizerOutput("", self.finish_reason)
        self.finished = True
        before = len(self.text)
        self.text += self._tail()
        return self._release(before, final=True)

    def _tail(self) -> str:
        """Decoded text of the tokens not yet read (incomplete characters included)."""
        ids = self._ids
        prefix_text = self.tokenizer.decode(
            ids[self._prefix_offset : self._read_offset], skip_special_tokens=self.skip_special_tokens
        )
        new_text = self.tokenizer.decode(ids[self._prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        self._prefix_offset = self._read_offset = len(ids)
        return new_text[len(prefix_text) :]

    def _release(self, before: int, final: bool) -> DetokenizerOutput:
        if self.stop:
            # A stop string that just completed starts at most max_stop - 1 characters
            # before the new text.
            start = max(0, before - self._max_stop + 1)
            hits = [(i, len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            if hits:
                at = min(i for i, _ in hits)  # the first stop string to start (the longest of those starting there)
                length = max(n for i, n in hits if i == at)
                cut = at + length if self.include_stop else at
                piece = self.text[self.emitted : cut]
                self.emitted = max(self.emitted, cut)
                self.finish_reason = "stop"
                self.finished = True
                return DetokenizerOutput(piece, "stop")
        end = len(self.text) if final else len(self.text) - self._held_for_stop()
        piece = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return DetokenizerOutput(piece)
