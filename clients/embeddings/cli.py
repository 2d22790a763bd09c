"""embed (or python -m clients): embed texts with the running server and print JSON.

Texts come from the arguments, from --file (one per line, blank lines skipped) or from
stdin (no arguments, or '-'). The default output is a JSON list of
{"text": ..., "embedding": [...]}, one record per line; --vectors-only prints the bare
vectors; --similarity prints the cosine-similarity matrix as a table (JSON with --json).

Exit status: 0 on success, 1 when the server refuses a request or cannot be reached,
2 for a usage error (bad options, no texts, unreadable file).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from clients.cli_common import UsageError, add_url_argument, check_retry_options, fail, parse, silence_stdout
from clients.embeddings.client import EmbeddingClient
from clients.embeddings.core import DEFAULT_MODEL, MAX_BATCH_SIZE, EmbeddingError, cosine_similarity_matrix
from clients.transport import PROTOCOLS

PROG = "embed"
LEGEND_WIDTH = 70  # characters of each text shown above the similarity table


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``embed`` command."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed; none or '-' reads stdin, one text per line")
    p.add_argument("-f", "--file", type=Path, help="read texts from this file, one per line ('-' = stdin)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="http", help="default http")
    add_url_argument(p, "http")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"default {DEFAULT_MODEL}")
    p.add_argument("--model-version", default="", help="default: the server's choice")
    p.add_argument(
        "--priority",
        type=int,
        default=0,
        help="request priority sent to Triton (0 = the model's default); the shipped configs define no priority "
        "levels, so the server ignores it (docs/performance.md)",
    )
    p.add_argument("--timeout", type=float, help="seconds allowed per attempt of a request")
    p.add_argument("--retries", type=int, help="retries of a request refused as unavailable or cut off (default 3; 0 = none)")
    p.add_argument("--deadline", type=float, help="seconds for all attempts and backoff of one request (default --timeout)")
    p.add_argument("--batch-size", type=int, default=MAX_BATCH_SIZE, help=f"texts per request, 1..{MAX_BATCH_SIZE}")
    p.add_argument(
        "--truncate",
        choices=("right", "left"),
        help="embed the first (right) or last (left) 256 tokens of a longer text (default: such a text is refused)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--similarity", action="store_true", help="print the cosine-similarity matrix of the texts instead")
    out.add_argument("--json", action="store_true", help="with --similarity: print it as JSON instead of a table")
    out.add_argument("--vectors-only", action="store_true", help="print a JSON list of vectors, without the texts")
    p.add_argument("-v", "--verbose", action="store_true", help="log each request to stderr")
    return p


def split_lines(data: str) -> list[str]:
    """One text per line: line endings (LF or CRLF) removed, blank lines skipped.

    Only ``\\n`` ends a line (``str.splitlines`` would also split on form feeds and
    Unicode separators inside a text).
    """
    texts = []
    for line in data.split("\n"):
        line = line.removesuffix("\r")
        if line.strip():
            texts.append(line)
    return texts


def read_stream(stream: IO[Any]) -> str:
    """All of a text or binary stream as str; bytes that are not UTF-8 are kept as
    surrogate escapes so the server, not this tool, judges them."""
    raw = getattr(stream, "buffer", stream).read()
    return raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw


def collect_texts(args: argparse.Namespace, stdin: IO[Any]) -> list[str]:
    """The texts to embed, from positional arguments, --file or stdin; UsageError if none."""
    from_stdin = args.texts == ["-"] or str(args.file) == "-"
    if args.file is not None and args.texts:
        raise UsageError("give texts as arguments or with --file, not both")
    if "-" in args.texts and args.texts != ["-"]:
        raise UsageError("'-' (read stdin) cannot be mixed with other texts")
    if args.file is not None and not from_stdin:
        try:
            texts = split_lines(args.file.read_bytes().decode("utf-8", "surrogateescape"))
        except OSError as exc:
            raise UsageError(f"cannot read {args.file}: {exc.strerror or exc}") from exc
        source = str(args.file)
    elif args.texts and not from_stdin:
        texts = list(args.texts)
        source = "the arguments"
    else:
        if getattr(stdin, "isatty", lambda: False)():
            logging.getLogger(PROG).warning("reading texts from stdin, one per line; end with Ctrl-D")
        texts = split_lines(read_stream(stdin))
        source = "stdin"
    if not texts:
        raise UsageError(f"no texts to embed in {source}")
    return texts


def check_options(args: argparse.Namespace) -> None:
    """Combinations argparse cannot express; UsageError on a bad one."""
    if args.similarity and args.vectors_only:
        raise UsageError("--vectors-only and --similarity cannot be combined")
    if args.priority < 0:
        raise UsageError(f"--priority must be >= 0, not {args.priority}")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, not {args.timeout}")
    check_retry_options(args)
    if not 1 <= args.batch_size <= MAX_BATCH_SIZE:
        raise UsageError(f"--batch-size must be in 1..{MAX_BATCH_SIZE}, not {args.batch_size}")


def float32_list(vector: np.ndarray) -> list[float]:
    """A float32 vector as Python floats that print with float32's shortest round-trip digits
    (``0.1``, not ``0.10000000149011612``)."""
    return [float(str(x)) for x in np.asarray(vector, dtype=np.float32)]


def format_embeddings(texts: Sequence[str], embeddings: np.ndarray, vectors_only: bool = False) -> str:
    """A JSON list with one record (or one bare vector) per line."""
    if vectors_only:
        rows = [json.dumps(float32_list(e)) for e in embeddings]
    else:
        rows = [json.dumps({"text": t, "embedding": float32_list(e)}) for t, e in zip(texts, embeddings)]
    return "[\n" + ",\n".join(rows) + "\n]" if rows else "[]"


def format_similarity_json(texts: Sequence[str], matrix: np.ndarray) -> str:
    """The similarity matrix and its texts as JSON, values rounded to 6 decimals."""
    return json.dumps({"texts": list(texts), "similarity": np.round(matrix.astype(np.float64), 6).tolist()})


def format_similarity_table(texts: Sequence[str], matrix: np.ndarray) -> str:
    """The matrix as an aligned table, with a legend that numbers the texts."""
    n = len(texts)
    labels = [f"[{i}]" for i in range(n)]
    width = max(len("-1.0000"), max(len(label) for label in labels))
    legend = [f"{label} {_shorten(text)}" for label, text in zip(labels, texts)]
    header = " " * width + "".join(f"  {label:>{width}}" for label in labels)
    rows = [f"{labels[i]:<{width}}" + "".join(f"  {matrix[i, j]:>{width}.4f}" for j in range(n)) for i in range(n)]
    return "\n".join(legend + ["", header] + rows)


def _shorten(text: str) -> str:
    # Keep the legend one line per text: control characters shown escaped, long texts cut.
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= LEGEND_WIDTH else text[: LEGEND_WIDTH - 1] + "…"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``embed`` command; returns the exit status (0 ok, 1 server error, 2 usage)."""
    args = parse(build_parser(), argv)
    if isinstance(args, int):  # argparse has printed the usage or --help already
        return args
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format=f"{PROG}: %(name)s: %(message)s")
    try:
        check_options(args)
        texts = collect_texts(args, sys.stdin)
        client = EmbeddingClient(
            url=args.url,
            protocol=args.protocol,
            model=args.model,
            model_version=args.model_version,
            timeout_s=args.timeout,
            priority=args.priority,
            batch_size=args.batch_size,
            retries=args.retries,
            deadline_s=args.deadline,
            truncation=args.truncate,
        )
    except (UsageError, ValueError) as exc:  # ValueError: options the client refuses, e.g. --url
        return fail(PROG, str(exc), 2)
    except KeyboardInterrupt:
        return fail(PROG, "interrupted", 130)
    try:
        with client:
            embeddings = client.embed(texts)
    except EmbeddingError as exc:
        return fail(PROG, str(exc), 1)
    except KeyboardInterrupt:
        return fail(PROG, "interrupted", 130)

    if not args.similarity:
        output = format_embeddings(texts, embeddings, vectors_only=args.vectors_only)
    elif args.json:
        output = format_similarity_json(texts, cosine_similarity_matrix(embeddings))
    else:
        output = format_similarity_table(texts, cosine_similarity_matrix(embeddings))
    try:
        sys.stdout.write(output + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `embed ... | head`; the reader has what it wanted
        silence_stdout()
        return 1
    return 0
