"""The router model (``text_encoder_router``) without Triton: its config checked at load, each
request's Job (the version that serves it), and one batch served through ``GroupServer``.

The model.py shim supplies ``call`` (the BLS call to one encoder version) and the metrics;
docs/versions-and-rollout.md describes the router.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from contract.errors import InputError
from contract.model_config import ModelConfig
from python_backends.routing.router import (
    CallTally,
    RateLimitedLog,
    RouterSettings,
    decide,
    describe,
    parse_parameters,
    versions_on_disk,
)
from python_backends.routing.serving import CallFn, GroupServer, Job, Outcome

log = logging.getLogger(__name__)

OUTPUT = "sentence_embedding"  # the encoder's output, passed on under the same name


class RouterEntry:
    def __init__(self, config: ModelConfig, repository: Path, is_ready: Callable[[str, str], bool], call: CallFn):
        config.require("input", "input_ids", "TYPE_INT64", (-1,))
        config.require("input", "attention_mask", "TYPE_INT64", (-1,))
        config.require("output", OUTPUT, "TYPE_FP32")
        config.require("output", "encoder_version", "TYPE_INT32", (1,))
        self.repository = Path(repository)
        self.settings = RouterSettings.from_config(config, self.repository)
        self.is_ready = is_ready
        self.warnings = RateLimitedLog()
        self.tally = CallTally()
        s = self.settings
        self.server = GroupServer(
            s.encoder, s.weights, s.fallback_on_error, self.ready_versions, call, self.tally, self.warnings.warn
        )
        # Off only to measure what the metrics cost (scripts/router_cost.py); the rollout
        # command judges canaries by these metrics.
        self.metrics_on = config.param_bool("metrics", True)
        self.metrics: Any = None
        log.info("%s: %s", config.name, describe(s))

    def use_metrics(self, metrics: Any) -> None:
        """Flush the tally to ``metrics`` (a routing.triton_metrics.RouterMetrics) from now on."""
        self.metrics = metrics

    def ready_versions(self) -> list[int]:
        """The encoder versions on disk that Triton reports ready, ascending."""
        encoder = self.settings.encoder
        return [v for v in versions_on_disk(self.repository / encoder) if self.is_ready(encoder, str(v))]

    def job(self, ids: np.ndarray, mask: np.ndarray, parameters: Any, request_id: str = "") -> Job:
        """One request's Job; InputError for mismatched inputs or a bad version pin."""
        if ids.shape != mask.shape:
            raise InputError("attention_mask", f"shape {list(mask.shape)} differs from input_ids' {list(ids.shape)}")
        decision = decide(self.settings.weights, parse_parameters(parameters), request_id, self.settings.versions_on_disk)
        return Job(ids, mask, decision)

    async def serve(self, jobs: Mapping[int, Job]) -> dict[int, Outcome]:
        """{request index: Outcome} for every job; the tally is flushed when due."""
        outcomes = await self.server.serve(jobs)
        if self.metrics_on and self.metrics is not None and self.tally.due():
            self.metrics.flush(self.tally)
        return outcomes

    def close(self) -> None:
        """The last counts, for a rollout judging this version."""
        if self.metrics_on and self.metrics is not None:
            self.metrics.flush(self.tally)
