"""``/v1/embeddings``: OpenAI's input forms checked and counted, split into Triton batches,
and the vectors written back in OpenAI's shape.

Texts go to the model's text entry point (the result cache by default), which answers each
text's vector and its token count (the tokenizer step's, kept in the cache beside the vector).
A text over the context length is refused by the model itself unless the request says
``truncate`` (TEI's ``truncate`` and ``truncation_direction``; docs/embeddings.md#truncation):
the model's error carries the text's index and count as data, and becomes 400
``context_length_exceeded``. Token arrays go to the encoder step with an attention mask, padded
to the tokenizer's buckets; their length is their count, checked (or truncated) before they are
sent.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from contract.errors import InputError
from contract.model_config import bucket_length
from contract.truncation import LEFT, RIGHT, parse_direction
from openai_gateway.catalog import EmbeddingModel
from openai_gateway.errors import APIError, bad_request, too_large
from openai_gateway.schemas import EmbeddingRequest
from openai_gateway.settings import GatewaySettings


class Vocabulary:
    """What the gateway needs of the model's tokenizer file to check token arrays: the
    vocabulary's size and the padding id. Texts are counted by the model's own tokenizer step
    (its NUM_TOKENS output), never here."""

    def __init__(self, tokenizer_file: Path):
        from tokenizers import Tokenizer

        if not Path(tokenizer_file).is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tokenizer_file} (run `make export`)")
        tok = Tokenizer.from_file(str(tokenizer_file))
        pad = tok.token_to_id("[PAD]")
        self.pad_id = 0 if pad is None else pad
        # A truncated token array keeps these at its ends where it has them, as the tokenizer step does.
        self.cls_id, self.sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        self.size = tok.get_vocab_size(with_added_tokens=True)


@dataclass
class EmbeddingJob:
    """A checked embeddings request: texts (as UTF-8) or token ids."""

    model: EmbeddingModel
    texts: list[str] | None  # one of texts and ids
    ids: list[list[int]] | None
    encoding_format: str
    blobs: list[bytes] | None = None  # the texts as UTF-8, what Triton gets
    priority_class: str | None = None  # X-Priority-Class (docs/priority-classes.md); None: default
    truncate: bool = False  # False: an input over the context length is refused (docs/embeddings.md#truncation)
    truncation_direction: str = RIGHT  # with truncate: right keeps the first tokens, left the last
    counts: list[int] | None = None  # token arrays: each one's length as sent (before truncation)

    @property
    def size(self) -> int:
        """The number of inputs."""
        rows = self.texts if self.texts is not None else self.ids
        assert rows is not None  # one of texts and ids
        return len(rows)

    def chunks(self) -> list[tuple[int, int]]:
        """[start, stop) spans of at most the entry model's max_batch_size, in order."""
        limit = self.model.max_batch_size if self.texts is not None else self.model.ids_max_batch_size
        return [(i, min(i + limit, self.size)) for i in range(0, self.size, limit)]


def check_request(
    req: EmbeddingRequest, model: EmbeddingModel, vocabulary: Vocabulary, settings: GatewaySettings
) -> EmbeddingJob:
    """The request as a job, or APIError naming the field and the limit it broke."""
    if req.dimensions is not None and req.dimensions != model.dimensions:
        raise bad_request(
            f"dimensions is not supported by {model.id}: it was not trained for shortened embeddings "
            f"(its vectors have {model.dimensions} dimensions; omit dimensions)",
            param="dimensions",
        )
    try:
        direction = parse_direction(req.truncation_direction, "truncation_direction")
    except InputError as exc:
        raise bad_request(f"truncation_direction {exc.message}", param="truncation_direction") from None
    value = req.input
    if isinstance(value, str):
        value = [value]
    if not value:
        raise bad_request("input must not be empty", param="input")
    # Before the count: one token array is one input, however many ids it has.
    if isinstance(value[0], int):  # one token array (the schema makes the list homogeneous)
        value = [value]
    if len(value) > settings.max_inputs:
        raise too_large(
            f"input has {len(value)} items; the limit is {settings.max_inputs} per request (--max-inputs)", param="input"
        )
    if isinstance(value[0], str):
        texts: list[str] = value
        limit = settings.max_input_chars
        blobs = []
        for i, text in enumerate(texts):
            if len(text) > limit:
                raise too_large(
                    f"input[{i}] has {len(text)} characters; the limit is {limit} (--max-input-chars)", param=f"input[{i}]"
                )
            if not text.strip():
                raise bad_request(f"input[{i}] is empty or only whitespace", param=f"input[{i}]")
            blobs.append(utf8(text, f"input[{i}]"))
        return EmbeddingJob(model, texts, None, req.encoding_format, blobs, truncate=req.truncate, truncation_direction=direction)
    ids: list[list[int]] = value
    vocab = vocabulary.size
    for i, row in enumerate(ids):
        if not row:
            raise bad_request(f"input[{i}] is an empty token array", param=f"input[{i}]")
        if len(row) > model.max_tokens and not req.truncate:
            break  # reported below with the count
        lo, hi = min(row), max(row)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise bad_request(f"input[{i}] has token id {bad}, outside {model.id}'s vocabulary [0, {vocab})", param=f"input[{i}]")
    counts = [len(row) for row in ids]
    if req.truncate:
        ids = [truncate_ids(row, model.max_tokens, direction, vocabulary) for row in ids]
    else:
        check_lengths(counts, model)
    return EmbeddingJob(
        model, None, ids, req.encoding_format, truncate=req.truncate, truncation_direction=direction, counts=counts
    )


def truncate_ids(row: list[int], limit: int, direction: str, vocabulary: Vocabulary) -> list[int]:
    """A token array cut to ``limit`` ids as the tokenizer step cuts a text: its first ids
    (``right``) or its last ones (``left``), a leading [CLS] and a trailing [SEP] kept in place."""
    if len(row) <= limit:
        return row
    lead = 1 if row[0] == vocabulary.cls_id else 0
    tail = 1 if row[-1] == vocabulary.sep_id else 0
    keep = limit - lead - tail
    content = row[lead : len(row) - tail]
    content = content[len(content) - keep :] if direction == LEFT else content[:keep]
    return row[:lead] + content + row[len(row) - tail :]


def utf8(text: str, param: str) -> bytes:
    """The UTF-8 of a text; 400 for a lone surrogate (JSON can carry ``"\\ud800"``, UTF-8 cannot)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"{param} is not valid Unicode: {exc.reason} at character {exc.start} (a lone surrogate escape)", param=param
        ) from None


def check_lengths(counts: Sequence[int] | np.ndarray, model: EmbeddingModel) -> None:
    """400 context_length_exceeded for the first input with more tokens than the model takes."""
    for i, n in enumerate(counts):
        if n > model.max_tokens:
            raise context_length_error(i, int(n), model)


def context_length_error(index: int, tokens: int, model: EmbeddingModel) -> APIError:
    """400 context_length_exceeded for input ``index`` of ``tokens`` tokens (the gateway's check
    of a token array, or the model's refusal of a text, read from its error data)."""
    return APIError(
        400,
        f"input[{index}] has {tokens} tokens; {model.id}'s maximum context length is {model.max_tokens} "
        "tokens (max_sequence_length in its config.pbtxt). Shorten or split the input, or send "
        '"truncate": true (and "truncation_direction": "right" or "left") to embed its first or last tokens.',
        param=f"input[{index}]",
        code="context_length_exceeded",
    )


def pad_ids(rows: list[list[int]], buckets: tuple[int, ...], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and attention_mask [n, L], L the smallest bucket that holds the longest row."""
    longest = max(len(r) for r in rows)
    length = max(bucket_length(longest, buckets), longest)
    ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), length), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


def response_body(job: EmbeddingJob, vectors: np.ndarray, prompt_tokens: int) -> bytes:
    """OpenAI's embeddings list; ``base64`` is the little-endian float32 bytes of each vector."""
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    if job.encoding_format == "base64":
        data = [
            {"object": "embedding", "index": i, "embedding": base64.b64encode(row.tobytes()).decode("ascii")}
            for i, row in enumerate(vectors)
        ]
    else:
        data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(vectors)]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return orjson.dumps(
        {"object": "list", "data": data, "model": job.model.id, "usage": usage},
        option=orjson.OPT_SERIALIZE_NUMPY,
    )
