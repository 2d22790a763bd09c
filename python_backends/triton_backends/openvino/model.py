"""Python-based Triton backend named ``openvino`` for servers without the native one.

Installed by the launcher as ``<backend-directory>/openvino/model.py``; every model whose config
says ``backend: "openvino"`` (the encoders' ``openvino`` variant, export/variants.py) then runs
here, on OpenVINO's CPU plugin, with the same ragged batching, padding metrics and lanes as the
``onnxruntime`` one (python_backends/onnx_engine/triton_model.py). In NVIDIA's container the native
C++ backend takes that name and reads the same config.pbtxt.
"""

import triton_python_backend_utils as pb_utils

from contract.errors import ConfigError
from python_backends.onnx_engine.openvino_session import OpenVINOSession, check_io, properties_from_config
from python_backends.onnx_engine.session import resolve_model_path
from python_backends.onnx_engine.triton_model import SessionModel


class TritonPythonModel(SessionModel):
    pb_utils = pb_utils

    def open(self, args, version_dir):
        if args.get("model_instance_kind", "CPU").upper() == "GPU":
            raise ConfigError(f"model {self.config.name!r}: the openvino backend runs on the CPU (instance kind GPU)")
        model_path = resolve_model_path(self.config, version_dir)
        session = OpenVINOSession(model_path, properties_from_config(self.config))
        check_io(self.config, session)
        return session, f"{model_path.name} on {session.describe()}"
