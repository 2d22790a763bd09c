"""Performance measurement of the served models with NVIDIA's perf_analyzer.

``perf.perf_analyzer`` finds and runs the binary and parses its results; ``perf.baseline``
(``python -m perf.baseline``) measures the ``text_embedding`` ensemble at a few
concurrencies. Input data lives in ``perf/data``; results go to ``perf/results`` (ignored
by git).
"""
