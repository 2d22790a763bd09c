"""Incremental detokenization over a byte-level BPE tokenizer trained here."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from python_backends.generation.detokenizer import (
    IncrementalDetokenizer,
    detokenize_incrementally,
)

CORPUS = [
    "The capital of France is Paris. Le café est très bon, n'est-ce pas?",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 in one line! ¿Qué tal? Ça va, naïve façade.",
    "def add(a, b):\n    return a + b  # Grüße aus Köln\n\nUser: hello\nAssistant: hi",
]
SPECIAL = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def texts():
    # Text the tokenizer was not trained on too: unseen characters split into byte tokens.
    return CORPUS + ["Ünïcödé 🦀 ∑ 漢字かな交じり文 — done."]


def test_tokenizer_really_splits_characters(tok):
    """The tests below mean something only if some tokens end mid-character."""
    mid = 0
    for text in texts():
        ids = tok.encode(text).ids
        mid += sum(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))
    assert mid > 10


@pytest.mark.parametrize("index", range(5))
def test_pieces_rebuild_every_prefix_and_never_split_a_character(tok, index):
    text = texts()[index]
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    for n in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.step(ids[:i]).text for i in range(1, n + 1)]
        streamed = "".join(pieces)
        full = tok.decode(ids[:n])
        assert not any("\ufffd" in p for p in pieces)
        # While the prefix ends mid-character only the complete part is out.
        assert full.startswith(streamed)
        if not full.endswith("\ufffd"):
            assert streamed == full
        assert streamed + detok.finish().text == full
        assert detok.step(ids[:n]).text == ""  # nothing after finish


def test_ids_arriving_several_at_a_time(tok):
    text = texts()[2]
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(ids[:n]).text for n in range(3, len(ids) + 1, 3)]
    pieces.append(detok.step(ids).text)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + detok.finish().text == text
    d = IncrementalDetokenizer(tok)
    d.step(ids[:4])
    with pytest.raises(ValueError, match="shrank"):
        d.step(ids[:2])


def test_prompt_is_context_not_output(tok):
    prompt = tok.encode("Le café est").ids
    out = tok.encode(" très bon 😀").ids
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    streamed = "".join(detok.step(out[:n]).text for n in range(1, len(out) + 1))
    assert streamed + detok.finish().text == " très bon 😀"


def test_special_tokens_skipped(tok):
    ids = tok.encode("Paris.").ids + [tok.token_to_id(SPECIAL)]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.step(ids[:n]).text for n in range(1, len(ids) + 1)) == "Paris."
    assert detok.finish().text == ""


def test_special_tokens_kept_when_asked(tok):
    ids = tok.encode("Paris.").ids + [tok.token_to_id(SPECIAL)]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    streamed = "".join(detok.step(ids[:n]).text for n in range(1, len(ids) + 1))
    assert streamed + detok.finish().text == "Paris." + SPECIAL


def stream(tok, text, stop, include_stop=False):
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, stop=stop, include_stop=include_stop)
    pieces, reason = [], None
    for n in range(1, len(ids) + 1):
        out = detok.step(ids[:n])
        pieces.append(out.text)
        if out.finish_reason:
            reason = out.finish_reason
            break
    if reason is None:
        out = detok.finish()
        pieces.append(out.text)
        reason = out.finish_reason
    return ids, pieces, reason


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        (
            "def add(a, b):\n    return a + b  # Grüße aus Köln\n\nUser: hello",
            ["\nUser:"],
            "def add(a, b):\n    return a + b  # Grüße aus Köln\n",
        ),
        ("Emoji: 😀🎉👍🏽 and more", ["🎉👍"], "Emoji: 😀"),
        ("東京は日本の首都です。北京是中国的首都。", ["首都。北", "本の首都で"], "東京は日"),
        ("The capital of France is Paris. Le café", ["Paris.", "is P"], "The capital of France "),
    ],
)
def test_stop_string_cut_and_never_partly_emitted(tok, text, stop, expected):
    ids, pieces, reason = stream(tok, text, stop)
    assert reason == "stop"
    assert "".join(pieces) == expected
    # The stop string spans several tokens: some prefix's complete text ends inside it,
    # which a naive stream would have shown.
    first, s = min((text.find(s), s) for s in stop if s in text)
    assert any(first < len(tok.decode(ids[:n]).rstrip("\ufffd")) < first + len(s) for n in range(1, len(ids)))
    # No piece, nor the text streamed at any point, ever contains part of a stop string
    # beyond what the final output holds.
    so_far = ""
    for piece in pieces:
        so_far += piece
        assert expected.startswith(so_far)


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("The capital of France is Paris. Le café", ["Paris.", "is P"], "The capital of France is P"),
        ("The capital of France is Paris. Le café", ["is", "is Paris"], "The capital of France is"),  # the first to complete
        ("Emoji: 😀🎉👍🏽 and more", ["🎉👍"], "Emoji: 😀🎉👍"),
    ],
)
def test_stop_string_kept_with_include_stop(tok, text, stop, expected):
    """include_stop_str_in_output: the text ends with the first stop string to complete, nothing after it."""
    _, pieces, reason = stream(tok, text, stop, include_stop=True)
    assert reason == "stop"
    assert "".join(pieces) == expected


def test_held_back_stop_prefix_is_released_when_it_is_not_a_stop(tok):
    text = "User: hello\nAssistant: hi"
    ids, pieces, reason = stream(tok, text, ["User: bye"])
    assert reason is None
    assert "".join(pieces) == text
    # "User: " was held while it could still become the stop string.
    detok = IncrementalDetokenizer(tok, stop=["User: bye"])
    ids = tok.encode("User: ").ids
    assert "".join(detok.step(ids[:n]).text for n in range(1, len(ids) + 1)) == ""
    assert detok.finish().text == "User: "


def test_low_level_offsets(tok):
    ids = tok.encode("😀").ids
    assert len(ids) > 1  # the emoji is several byte tokens here
    prefix, read = 0, 0
    outs = []
    for n in range(1, len(ids) + 1):
        piece, prefix, read = detokenize_incrementally(tok, ids[:n], prefix, read)
        outs.append(piece)
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "😀"
    assert (prefix, read) == (0, len(ids))


@pytest.mark.parametrize(
    "text, stops, streamed",
    [
        ("xaba", ["abab"], "x"),  # the longest held tail, not the first one found
        ("xabab", ["ababc"], "x"),
        ("xabab", ["abc"], "xab"),
        ("naïve aa", ["aab", "zz"], "naïve "),
        ("café a", ["b", "ab"], "café "),
        ("café", ["éx"], "caf"),
    ],
)
def test_hold_back_is_the_longest_possible_stop_start(tok, text, stops, streamed):
    detok = IncrementalDetokenizer(tok, stop=stops)
    out = detok.step(tok.encode(text).ids)
    assert out.finish_reason is None
    assert detok.output_text == streamed
    assert out.text + detok.finish().text == text
