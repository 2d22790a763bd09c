"""Triton shim for the canary router (python_backends.routing.entry): BLS calls to each request's text_encoder version."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.routing.entry import OUTPUT, RouterEntry
from python_backends.routing.serving import CallError, call_error
from python_backends.routing.triton_metrics import RouterMetrics
from python_backends.shim import check_input_shapes, error_response, input_numpy
from python_backends.shim_base import AsyncBatchShim


class TritonPythonModel(AsyncBatchShim):
    pb_utils = pb_utils
    entry = metrics = None

    def load(self, args):
        self.entry = RouterEntry(self.config, Path(args["model_repository"]).parent, pb_utils.is_model_ready, self._call)
        self.metrics = RouterMetrics(pb_utils, self.entry.settings.encoder, args.get("model_instance_name", ""))
        self.entry.use_metrics(self.metrics)

    async def _call(self, version, ids, mask):
        request = pb_utils.InferenceRequest(
            model_name=self.entry.settings.encoder,
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

    def decode(self, request):
        check_input_shapes(pb_utils, request, self.config)
        ids, mask = (input_numpy(pb_utils, request, name) for name in ("input_ids", "attention_mask"))
        return self.entry.job(ids, mask, request.parameters(), request.request_id())

    async def run(self, jobs):
        return (await self.entry.serve(jobs)).items()

    def encode(self, outcome):
        if outcome.error is not None:
            return error_response(pb_utils, self.config.name, outcome.exception())
        vectors = pb_utils.Tensor(OUTPUT, np.ascontiguousarray(outcome.vectors))
        return pb_utils.InferenceResponse(output_tensors=[vectors, pb_utils.Tensor("encoder_version", outcome.version_column())])

    def close(self):
        if self.entry is not None:
            self.entry.close()  # the last counts, for a rollout judging this version

    def metric_objects(self):
        return self.metrics.objects() if self.metrics is not None else []
