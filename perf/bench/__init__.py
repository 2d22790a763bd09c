"""The benchmarks: one tool per question, each ``python -m perf.bench.<name>`` (most behind a ``make`` target)."""
