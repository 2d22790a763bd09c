"""The command-line options the benchmarks repeat: the run's shape (rounds, seconds, warm-up,
precision, results folder), the load generator, and the argparse types of comma-separated lists
(numbers, or a subset of what a tool knows)."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """``python -m <prog>``'s parser, its module docstring as the description."""
    return argparse.ArgumentParser(
        prog=f"python -m {prog}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_run(p: argparse.ArgumentParser, kind: str, rounds: int, duration: float, warmup: float, precision: str = "cpu") -> None:
    """--rounds, --duration and --warmup of interleaved windows, --precision and --out-dir."""
    p.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds per point (default {rounds})")
    p.add_argument("--duration", type=float, default=duration, help=f"measured seconds per window (default {duration:g})")
    p.add_argument("--warmup", type=float, default=warmup, help=f"unmeasured seconds before each window (default {warmup:g})")
    p.add_argument(
        "--precision", default=precision, help=f"what the server serves, as `make serve PRECISION=` (default {precision})"
    )
    p.add_argument("--out-dir", type=Path, help=f"results folder (default perf/results/{kind}-<UTC time>)")


def add_client(p: argparse.ArgumentParser, note: str = "") -> None:
    """--client: wrk when installed (auto), or the asyncio client of perf.lib.load."""
    choices = ("auto", "wrk", "python")
    p.add_argument(
        "--client", choices=choices, default="auto", help=f"load generator: wrk when installed (auto), else asyncio{note}"
    )


def add_peak(p: argparse.ArgumentParser, load: float = 0.7, seconds: float = 20.0, concurrency: int = 16) -> None:
    """The drills' open-loop rate: --rate, or --load x the peak --peak-concurrency closed-loop clients measure in --peak-seconds."""
    p.add_argument("--rate", type=float, help="arrivals per second; default: --load x the measured peak")
    p.add_argument("--load", type=float, default=load, help=f"share of the measured peak to run at (default {load:g})")
    p.add_argument("--peak-seconds", type=float, default=seconds, help=f"length of the peak measurement (default {seconds:g})")
    p.add_argument(
        "--peak-concurrency",
        type=int,
        default=concurrency,
        help=f"closed-loop clients measuring the peak (default {concurrency})",
    )


def finish(p: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None) -> argparse.Namespace:
    """The run's checks (positive rounds and seconds, wrk present when asked for) and what follows from
    them: ``args.argv`` (the command line, for the report) and ``args.use_wrk``."""
    if getattr(args, "rounds", 1) < 1 or getattr(args, "duration", 1) <= 0:
        p.error("--rounds and --duration must be positive")
    client = getattr(args, "client", "python")
    if client == "wrk" and not shutil.which("wrk"):
        p.error("--client wrk: wrk is not installed (Debian package wrk)")
    args.use_wrk = client == "wrk" or (client == "auto" and shutil.which("wrk") is not None)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def int_list(text: str, low: float = 1, kind: type = int) -> list:
    """An argparse type: comma-separated numbers (``kind``) of at least ``low`` (``1,8,16``)."""
    try:
        values = [kind(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers of at least {low:g}, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    """An argparse type: comma-separated positive numbers (``0.25,0.5``)."""
    return int_list(text, 1e-9, float)


def choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated subset of ``allowed``."""

    def parse(text: str) -> list[str]:
        values = [v for v in text.replace(" ", "").split(",") if v]
        if not values or set(values) - set(allowed):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return list(dict.fromkeys(values))

    return parse
