"""`python -m perf.bench.baseline` (`make perf-baseline`): the minimal sweep of the text_embedding ensemble.

perf.bench.sweep with these presets: text_embedding with the checked-in 16-token sentences over
gRPC, concurrency 1 and 16, fixed windows of 400 requests, no request-rate points, a 600 s budget.
Any sweep option given here wins over them; --url HOST:PORT measures a running server instead of
starting one. Writes what the sweep writes under perf/results/baseline-<UTC time>/ (sweep.csv,
summary.md with each step's queue, compute and batch, perf_analyzer's CSV and log per level).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from perf.bench import sweep
from perf.lib.report import results_dir

PRESET = (
    "--models text_embedding --text-data 16tok --protocols grpc --concurrency 1,16 --no-rates "
    "--window-s 0 --request-count 400 --time-budget 600"
).split()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" not in argv and "--help" not in argv and not any(a.startswith("--out-dir") for a in argv):
        argv += ["--out-dir", str(results_dir(None, "baseline"))]
    return sweep.main([*PRESET, *argv])


if __name__ == "__main__":
    sys.exit(main())
