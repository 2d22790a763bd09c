"""Python-based Triton backend named ``openvino`` for servers without the native one.

Installed by the launcher as ``<backend-directory>/openvino/model.py``; every model whose config
says ``backend: "openvino"`` (the encoders' ``openvino`` variant, export/variants.py) then runs
here, on OpenVINO's CPU plugin, with the same ragged batching, padding metrics and lanes as the
``onnxruntime`` one. In NVIDIA's container the native C++ backend takes that name and reads the
same config.pbtxt.
"""

from pathlib import Path

import triton_python_backend_utils as pb_utils

from python_backends.admission.yielding import yield_from_config
from python_backends.config import ModelConfig
from python_backends.errors import ConfigError
from python_backends.onnx_engine.batching import budget_from_config, run_batched
from python_backends.onnx_engine.openvino_session import OpenVINOSession, check_io, properties_from_config
from python_backends.onnx_engine.session import resolve_model_path
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


class TritonPythonModel:
    def initialize(self, args):
        install_logging(pb_utils)
        self.config = ModelConfig(args["model_config"])
        try:
            apply_process_nice(self.config)  # before the session: its threads inherit it
            version_dir = Path(args["model_repository"]) / args["model_version"]
            if args.get("model_instance_kind", "CPU").upper() == "GPU":
                raise ConfigError(f"model {self.config.name!r}: the openvino backend runs on the CPU (instance kind GPU)")
            model_path = resolve_model_path(self.config, version_dir)
            self.session: OpenVINOSession | None = OpenVINOSession(model_path, properties_from_config(self.config))
            check_io(self.config, self.session)
            # Inputs declared allow_ragged_batch: rows trimmed and grouped under a token budget.
            self.budget = budget_from_config(self.config)
            # A lower class's encoder waits between runs while the higher class has work in flight.
            self.yielder = yield_from_config(self.config)
        except Exception as exc:
            raise load_error(pb_utils, self.config.name, exc) from exc
        self.input_names = [spec.name for spec in self.config.inputs]
        self.output_names = [spec.name for spec in self.config.outputs]
        # Token models (an attention-mask input) report the real and padded tokens of the runs
        # OpenVINO really made (python_backends/padding_metrics.py); the native backend cannot.
        length_input = self.budget.length_input if self.budget else "attention_mask"
        self.metrics = self.tally = None
        if length_input in self.input_names:
            self.tally = RunTally(length_input)
            self.metrics = PaddingMetrics(pb_utils, self.config.name, args["model_version"])
        pb_utils.Logger.log_info(
            f"{self.config.name}: {model_path.name} on {self.session.describe()}"
            + (f", ragged batches of at most {self.budget.max_tokens} tokens per run" if self.budget else "")
        )
        freeze_loaded_objects()

    def _run(self, feed):
        assert self.session is not None, "finalized"
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
                    tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
                    if tensor is not None:
                        inputs[spec.name] = tensor.as_numpy()
                        check_shape(spec.name, tensor.shape(), spec.dims, self.config.max_batch_size, size=inputs[spec.name].size)
            except Exception as exc:
                responses[i] = error_response(pb_utils, self.config.name, exc, request.request_id())
                continue
            feeds.append(inputs)
            owners.append(i)
        run = self.tally.wrap(self._run) if self.tally else self._run
        if self.yielder:
            run = self.yielder.wrap(run)
        for i, outcome in zip(owners, run_batched(feeds, self.input_names, run, self.budget)):
            if outcome.error is not None:
                responses[i] = error_response(pb_utils, self.config.name, outcome.error, requests[i].request_id())
            else:
                assert outcome.outputs is not None  # run_batched gives outputs or an error
                responses[i] = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(name, value) for name, value in outcome.outputs.items()]
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
