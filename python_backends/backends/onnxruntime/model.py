"""Python-based Triton backend named ``onnxruntime`` for servers without the native one.

Installed by the launcher as ``<backend-directory>/onnxruntime/model.py``; every model whose
config says ``backend: "onnxruntime"`` then runs here. In NVIDIA's container the native C++
backend takes that name and reads the same config.pbtxt.
"""

import onnxruntime as ort
import triton_python_backend_utils as pb_utils
from pathlib import Path

from python_backends.config import ModelConfig
from python_backends.ort_backend.batching import run_batched
from python_backends.ort_backend.session import check_io, open_session, plan_session, resolve_model_path
from python_backends.shim import error_response, install_logging, load_error


class TritonPythonModel:
    def initialize(self, args):
        install_logging(pb_utils)
        self.config = ModelConfig(args["model_config"])
        try:
            version_dir = Path(args["model_repository"]) / args["model_version"]
            plan = plan_session(
                self.config,
                resolve_model_path(self.config, version_dir),
                instance_kind=args.get("model_instance_kind", "CPU"),
                device_id=int(args.get("model_instance_device_id", 0)),
                available_providers=ort.get_available_providers(),
            )
            self.session = open_session(plan)
            check_io(self.config, self.session)
        except Exception as exc:
            raise load_error(pb_utils, self.config.name, exc)
        self.input_names = [spec.name for spec in self.config.inputs]
        self.output_names = [spec.name for spec in self.config.outputs]
        pb_utils.Logger.log_info(
            f"{self.config.name}: {plan.model_path.name} on {self.session.get_providers()[0]}, "
            f"intra_op_threads={plan.intra_op_threads or 'default'}"
        )

    def _run(self, feed):
        return dict(zip(self.output_names, self.session.run(self.output_names, feed)))

    def execute(self, requests):
        feeds = []
        for request in requests:
            inputs = {}
            for name in self.input_names:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            feeds.append(inputs)
        responses = []
        for request, outcome in zip(requests, run_batched(feeds, self.input_names, self._run)):
            if outcome.error is not None:
                responses.append(error_response(pb_utils, self.config.name, outcome.error, request.request_id()))
            else:
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(name, value) for name, value in outcome.outputs.items()]
                    )
                )
        return responses

    def finalize(self):
        self.session = None
