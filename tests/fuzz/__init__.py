"""Fuzzing: the served endpoints (hypothesis), the gateway (schemathesis) and the decoding functions (atheris)."""
