"""Check perf/data/sentences_16tok.json, perf_analyzer's input data for the ensemble, and keep its layout.

Sixty hand-written English sentences on varied topics (the JSON is their one copy), each exactly
16 tokens after all-MiniLM-L6-v2's WordPiece tokenization including [CLS] and [SEP], so every
request stays in the tokenizer's smallest sequence bucket and a benchmark measures one fixed
encoder shape.

    python -m perf.data.make_sentences           # rewrite the JSON in its layout (one request a line)
    python -m perf.data.make_sentences --check   # verify lengths, no duplicates, and the layout

Needs the exported tokenizer (model_repository/text_tokenizer/1/tokenizer.json, `make export`).
"""

from __future__ import annotations

import argparse
import json
import sys

from perf.lib.paths import REPOSITORY, ROOT
from perf.lib.paths import SENTENCES_16TOK as OUTPUT

TOKENIZER = REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json"
INPUT_NAME = "TEXT"  # the text_embedding ensemble's input
TOKENS = 16  # with [CLS] and [SEP]


def sentences() -> list[str]:
    return [entry[INPUT_NAME]["content"][0] for entry in json.loads(OUTPUT.read_text(encoding="utf-8"))["data"]]


def render(texts: list[str]) -> str:
    """perf_analyzer's real-input JSON, one batch-1 request per line so that diffs stay readable."""
    entries = [json.dumps({INPUT_NAME: {"content": [s], "shape": [1]}}, ensure_ascii=False) for s in texts]
    return '{"data": [\n  ' + ",\n  ".join(entries) + "\n]}\n"


def problems(texts: list[str]) -> list[str]:
    """Duplicates and sentences of the wrong length, as the served tokenizer counts (no padding)."""
    from tokenizers import Tokenizer

    if not TOKENIZER.is_file():
        raise SystemExit(f"{TOKENIZER} not found; run `make export` first")
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    found = [f"duplicate: {s!r}" for i, s in enumerate(texts) if s in texts[:i]]
    for sentence, encoding in zip(texts, tokenizer.encode_batch(texts)):
        if len(encoding.ids) != TOKENS:
            found.append(f"{len(encoding.ids)} tokens (want {TOKENS}): {sentence!r}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only verify; exit 1 on any problem")
    args = parser.parse_args(argv)
    texts = sentences()
    found = problems(texts)
    text = render(texts)
    if args.check and OUTPUT.read_text(encoding="utf-8") != text:
        found.append(f"{OUTPUT.name} is not in its layout; run `python -m perf.data.make_sentences`")
    for problem in found:
        print(problem, file=sys.stderr)
    if found:
        return 1
    if not args.check:
        OUTPUT.write_text(text, encoding="utf-8")
    print(f"{OUTPUT.relative_to(ROOT)}: {len(texts)} sentences of {TOKENS} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
