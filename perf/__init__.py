"""Measuring and drilling the served deployment: a library and the rooms built on it.

- ``perf.lib``: the shared measurement library (paths, percentiles, the perf_analyzer driver and the
  harness around it, Triton's statistics, process CPU and memory, request bodies, the deployment,
  chat stream clients). It imports nothing from the rooms below.
- ``perf.baselines``: what the served models are measured against (the in-process ceiling, the
  naive per-request server, llama.cpp's ``llama-server``, OpenVINO GenAI, infinity-emb).
- ``perf.bench``: the benchmarks, one question each (``python -m perf.bench.<name>``, most behind a
  ``make`` target).
- ``perf.drills``: the deployment soaked and hurt under load (soak, chaos, replica failover).

Inputs are checked in under ``perf/data``; results go to ``perf/results`` (ignored by git).
perf/README.md lists every command.
"""
