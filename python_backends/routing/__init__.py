"""Canary routing of text_encoder versions (issue 6): weights, the sticky choice, the served version.

Pure Python, no Triton import: the router model (model_repository/text_encoder_router), the
rollout command (ops/rollout.py) and the result cache can all call it.
"""

from python_backends.routing.weights import (
    BUCKETS,
    RoutingError,
    choose_version,
    format_weights,
    parse_weights,
    route_bucket,
    validate_weights,
)

__all__ = [
    "BUCKETS",
    "RoutingError",
    "choose_version",
    "format_weights",
    "parse_weights",
    "route_bucket",
    "validate_weights",
]
