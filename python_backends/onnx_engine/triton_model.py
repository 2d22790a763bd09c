"""The Triton model of this project's Python-based backends (python_backends/triton_backends/<name>/
model.py: ``onnxruntime``, ``openvino``): a runtime's session behind Triton's dynamic batcher, with
per-request shape checks, ragged batches under a token budget, a failed batch rerun request by
request, padding metrics and the lanes' yielding. Each backend's model.py only opens its session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contract.model_config import ModelConfig
from python_backends.admission.yielding import yield_from_config
from python_backends.onnx_engine.batching import budget_from_config, run_batched
from python_backends.padding_metrics import PaddingMetrics, RunTally
from python_backends.shim import (
    apply_process_nice,
    check_shape,
    error_response,
    freeze_loaded_objects,
    install_logging,
    keep_metrics,
    load_error,
)


class SessionModel:
    """The Triton model a Python-based backend runs: a subclass sets ``pb_utils`` (its
    ``triton_python_backend_utils``) and opens the runtime's session in :meth:`open`."""

    pb_utils: Any = None
    session: Any = None

    def open(self, args: dict, version_dir: Path) -> tuple[Any, str]:
        """The session (``run(output_names, feed)``, checked against the config) and what it runs
        on, for the load log (``model.onnx on CPUExecutionProvider, ...``)."""
        raise NotImplementedError

    def initialize(self, args):
        install_logging(self.pb_utils)
        self.config = ModelConfig(args["model_config"])
        try:
            apply_process_nice(self.config)  # before the session: its threads inherit it
            version_dir = Path(args["model_repository"]) / args["model_version"]
            self.session, runs_on = self.open(args, version_dir)
            # Inputs declared allow_ragged_batch: rows trimmed and grouped under a token budget.
            self.budget = budget_from_config(self.config)
            # A lower class's encoder waits between runs while the higher class has work in flight.
            self.yielder = yield_from_config(self.config)
        except Exception as exc:
            raise load_error(self.pb_utils, self.config.name, exc) from exc
        self.input_names = [spec.name for spec in self.config.inputs]
        self.output_names = [spec.name for spec in self.config.outputs]
        # Token models (an attention-mask input) report the real and padded tokens of the runs
        # the runtime really made (python_backends/padding_metrics.py); the native backends cannot.
        length_input = self.budget.length_input if self.budget else "attention_mask"
        self.metrics = self.tally = None
        if length_input in self.input_names:
            self.tally = RunTally(length_input)
            self.metrics = PaddingMetrics(self.pb_utils, self.config.name, args["model_version"])
        self.pb_utils.Logger.log_info(
            f"{self.config.name}: {runs_on}"
            + (f", ragged batches of at most {self.budget.max_tokens} tokens per run" if self.budget else "")
        )
        freeze_loaded_objects()

    def _run(self, feed):
        return dict(zip(self.output_names, self.session.run(self.output_names, feed)))

    def execute(self, requests):
        responses = [None] * len(requests)
        feeds, owners = [], []
        for i, request in enumerate(requests):
            inputs = {}
            try:
                # Declared shape against the config and the elements received, before the request
                # joins a batch: a batch of 2^32 or more arrives truncated (server/frontdoor.py).
                for spec in self.config.inputs:
                    tensor = self.pb_utils.get_input_tensor_by_name(request, spec.name)
                    if tensor is not None:
                        inputs[spec.name] = tensor.as_numpy()
                        check_shape(spec.name, tensor.shape(), spec.dims, self.config.max_batch_size, size=inputs[spec.name].size)
            except Exception as exc:
                responses[i] = error_response(self.pb_utils, self.config.name, exc, request.request_id())
                continue
            feeds.append(inputs)
            owners.append(i)
        run = self.tally.wrap(self._run) if self.tally else self._run
        if self.yielder:
            run = self.yielder.wrap(run)
        for i, outcome in zip(owners, run_batched(feeds, self.input_names, run, self.budget)):
            if outcome.error is not None:
                responses[i] = error_response(self.pb_utils, self.config.name, outcome.error, requests[i].request_id())
            else:
                assert outcome.outputs is not None  # run_batched gives outputs or an error
                responses[i] = self.pb_utils.InferenceResponse(
                    output_tensors=[self.pb_utils.Tensor(name, value) for name, value in outcome.outputs.items()]
                )
        if self.tally and self.metrics is not None:
            real, padded, _ = self.tally.take()
            self.metrics.record(real, padded)
        return responses

    def finalize(self):
        self.session = None
        if self.metrics:
            self.metrics.close()
            keep_metrics(*self.metrics.objects())  # never deleted: see keep_metrics
