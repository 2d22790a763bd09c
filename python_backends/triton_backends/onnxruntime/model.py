"""Python-based Triton backend named ``onnxruntime`` for servers without the native one.

Installed by the launcher as ``<backend-directory>/onnxruntime/model.py``; every model whose
config says ``backend: "onnxruntime"`` then runs here. In NVIDIA's container the native C++
backend takes that name and reads the same config.pbtxt. What it does around the session:
python_backends/onnx_engine/triton_model.py.
"""

import onnxruntime as ort
import triton_python_backend_utils as pb_utils

from python_backends.onnx_engine.session import check_io, open_session, plan_session, resolve_model_path
from python_backends.onnx_engine.triton_model import SessionModel


class TritonPythonModel(SessionModel):
    pb_utils = pb_utils

    def open(self, args, version_dir):
        plan = plan_session(
            self.config,
            resolve_model_path(self.config, version_dir),
            instance_kind=args.get("model_instance_kind", "CPU"),
            device_id=int(args.get("model_instance_device_id", 0)),
            available_providers=ort.get_available_providers(),
        )
        session = open_session(plan)
        check_io(self.config, session)
        return session, (
            f"{plan.model_path.name} on {session.get_providers()[0]}, intra_op_threads={plan.intra_op_threads or 'default'}"
        )
