"""Triton shim for the canary router: picks a text_encoder version per request, calls it through BLS."""

import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.config import ModelConfig
from python_backends.errors import InputError
from python_backends.routing.router import (
    CALLS_METRIC,
    LATENCY_METRIC,
    CallTally,
    RateLimitedLog,
    RouterSettings,
    decide,
    describe,
    parse_parameters,
    versions_on_disk,
)
from python_backends.routing.serving import CallError, GroupServer, Job, call_error
from python_backends.shim import (
    check_input_shapes,
    error_response,
    freeze_loaded_objects,
    input_numpy,
    install_logging,
    keep_metrics,
    load_error,
)

OUTPUT = "sentence_embedding"


class TritonPythonModel:
    def initialize(self, args):
        install_logging(pb_utils)
        self.config = ModelConfig(args["model_config"])
        try:
            self.config.require("input", "input_ids", "TYPE_INT64", (-1,))
            self.config.require("input", "attention_mask", "TYPE_INT64", (-1,))
            self.config.require("output", OUTPUT, "TYPE_FP32")
            self.config.require("output", "encoder_version", "TYPE_INT32", (1,))
            self.repository = Path(args["model_repository"]).parent
            self.settings = RouterSettings.from_config(self.config, self.repository)
        except Exception as exc:
            raise load_error(pb_utils, self.config.name, exc) from exc
        self.warnings = RateLimitedLog()
        # Kept on self: a MetricFamily must outlive its Metric objects, or the next set() fails.
        self.calls_family = pb_utils.MetricFamily(
            name=CALLS_METRIC,
            description="Requests the router sent to text_encoder, by version and result (ok, error, rejected)",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.latency_family = pb_utils.MetricFamily(
            name=LATENCY_METRIC + "_bucket",
            description="The router's successful text_encoder calls at most le ms long (cumulative buckets)",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        # One series per router process: a reloaded router starts new ones (ops/rollout.py
        # takes per-series deltas).
        self.instance = f"{args.get('model_instance_name', '')}/pid{os.getpid()}"
        self.metrics = {}
        self.tally = CallTally()
        self.server = GroupServer(
            self.settings.encoder,
            self.settings.weights,
            self.settings.fallback_on_error,
            self._ready_versions,
            self._call,
            self.tally,
            self.warnings.warn,
        )
        # Off only to measure what the metrics cost (scripts/router_cost.py); the rollout
        # command judges canaries by these metrics.
        self.metrics_on = self.config.param_bool("metrics", True)
        pb_utils.Logger.log_info(f"{self.config.name}: {describe(self.settings)}")
        freeze_loaded_objects()

    def _ready_versions(self):
        encoder = self.settings.encoder
        return [v for v in versions_on_disk(self.repository / encoder) if pb_utils.is_model_ready(encoder, str(v))]

    def _metric(self, family, labels):
        key = (family.__class__, id(family), tuple(sorted(labels.items())))
        metric = self.metrics.get(key)
        if metric is None:
            metric = self.metrics[key] = family.Metric(labels=labels)
        return metric

    def _flush(self):
        results, buckets = self.tally.drain()
        base = {"model": self.settings.encoder, "instance": self.instance}
        for (version, result), n in results.items():
            self._metric(self.calls_family, {**base, "version": str(version), "result": result}).increment(n)
        for (version, le), n in buckets.items():
            self._metric(self.latency_family, {**base, "version": str(version), "le": le}).increment(n)

    async def _call(self, version, ids, mask):
        request = pb_utils.InferenceRequest(
            model_name=self.settings.encoder,
            model_version=version,
            inputs=[pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("attention_mask", mask)],
            requested_output_names=[OUTPUT],
        )
        response = await request.async_exec()
        if response.has_error():
            error = response.error()
            raise call_error(error.message(), error.code() == pb_utils.TritonError.INVALID_ARG)
        tensor = pb_utils.get_output_tensor_by_name(response, OUTPUT)
        if tensor is None:
            raise CallError(f"the response has no output {OUTPUT!r}")
        return tensor.as_numpy()

    async def execute(self, requests):
        responses = [None] * len(requests)
        jobs = {}
        known = self.settings.versions_on_disk
        for i, request in enumerate(requests):
            try:
                check_input_shapes(pb_utils, request, self.config)
                ids = input_numpy(pb_utils, request, "input_ids")
                mask = input_numpy(pb_utils, request, "attention_mask")
                if ids.shape != mask.shape:
                    raise InputError("attention_mask", f"shape {list(mask.shape)} differs from input_ids' {list(ids.shape)}")
                decision = decide(self.settings.weights, parse_parameters(request.parameters()), request.request_id(), known)
            except Exception as exc:
                responses[i] = error_response(pb_utils, self.config.name, exc, request.request_id())
                continue
            jobs[i] = Job(ids, mask, decision)
        for i, outcome in (await self.server.serve(jobs)).items():
            if outcome.error is not None:
                code = (
                    pb_utils.TritonError.INVALID_ARG
                    if outcome.invalid
                    else pb_utils.TritonError.INTERNAL
                    if outcome.internal
                    else pb_utils.TritonError.UNAVAILABLE
                )
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"{self.config.name}: {outcome.error}", code)
                )
            else:
                rows = outcome.vectors.shape[0]
                responses[i] = pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor(OUTPUT, np.ascontiguousarray(outcome.vectors)),
                        pb_utils.Tensor("encoder_version", np.full((rows, 1), outcome.served, dtype=np.int32)),
                    ]
                )
        if self.metrics_on and self.tally.due():
            self._flush()
        return responses

    def finalize(self):
        if self.metrics_on:
            self._flush()  # the last counts, for a rollout judging this version
        keep_metrics(*self.metrics.values(), self.calls_family, self.latency_family)  # never deleted: see keep_metrics
