"""What the command lines share (``embed``: clients/embeddings/cli.py; ``generate`` and ``chat``:
clients/generation/cli.py): the ``--url`` option, the retry options' checks, usage errors, and
the one-line error message and exit status."""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Sequence
from typing import IO

from clients.transport import DEFAULT_URLS


class UsageError(Exception):
    """Bad command-line input; exit status 2."""


def add_url_argument(parser: argparse.ArgumentParser, protocol: str) -> None:
    """``--url``, repeatable or comma-separated; the help names ``protocol``'s default first."""
    other = "grpc" if protocol == "http" else "http"
    parser.add_argument(
        "--url",
        action="append",
        help=f"host:port of the server (default {DEFAULT_URLS[protocol]} for {protocol}, {DEFAULT_URLS[other]} "
        f"for {other}); repeat it or give a comma-separated list to fail over across several servers",
    )


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status when argparse has printed the usage or --help."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2


def check_retry_options(args: argparse.Namespace) -> None:
    """``--retries`` and ``--deadline``, checked before connecting; UsageError on a bad one."""
    if args.retries is not None and args.retries < 0:
        raise UsageError(f"--retries must be >= 0, not {args.retries}")
    if args.deadline is not None and not args.deadline > 0:
        raise UsageError(f"--deadline must be > 0 seconds, not {args.deadline}")


def fail(prog: str, message: str, status: int, err: IO[str] | None = None) -> int:
    """Write ``prog: error: message`` as one line (it reads well in logs and pipelines); ``status``."""
    (err or sys.stderr).write(f"{prog}: error: {' '.join(message.split())}\n")
    return status


def silence_stdout() -> None:
    """After a broken pipe (``... | head``): Python flushes stdout again at exit, so point it at
    /dev/null, where that flush cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass
