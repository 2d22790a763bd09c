"""The shared measurement library: paths, percentiles, the perf_analyzer driver and harness, Triton's
statistics, process accounting, request bodies, the deployment and chat stream clients the tools drive."""
