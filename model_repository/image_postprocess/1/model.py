"""Triton shim for the postprocessing step: logits [n, 1000] -> LABEL, CLASS_INDEX, SCORE [n, k]."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from contract.model_config import ModelConfig
from python_backends.image.postprocess import TopKClassifier, load_labels
from python_backends.shim import (
    check_input_shapes,
    error_response,
    freeze_loaded_objects,
    input_numpy,
    install_logging,
    load_error,
)


class TritonPythonModel:
    def initialize(self, args):
        install_logging(pb_utils)
        self.config = ModelConfig(args["model_config"])
        try:
            (classes,) = self.config.require("input", "logits", "TYPE_FP32").dims
            k = self.config.param_int("top_k", 5, minimum=1)
            for name, dtype in (("LABEL", "TYPE_STRING"), ("CLASS_INDEX", "TYPE_INT64"), ("SCORE", "TYPE_FP32")):
                self.config.require("output", name, dtype, (k,))
            version_dir = Path(args["model_repository"]) / args["model_version"]
            labels = load_labels(version_dir / (self.config.param("labels_file") or "labels.txt"), expected=classes)
            self.classify = TopKClassifier(labels, k)
        except Exception as exc:
            raise load_error(pb_utils, self.config.name, exc) from exc
        freeze_loaded_objects()

    def execute(self, requests):
        responses = [None] * len(requests)
        arrays, owners = [], []
        for i, request in enumerate(requests):
            try:
                check_input_shapes(pb_utils, request, self.config)
                arrays.append(input_numpy(pb_utils, request, "logits"))
                owners.append(i)
            except Exception as exc:
                responses[i] = error_response(pb_utils, self.config.name, exc, request.request_id())
        for i, result in zip(owners, self.classify.per_request(arrays)):
            if isinstance(result, Exception):
                responses[i] = error_response(pb_utils, self.config.name, result, requests[i].request_id())
            else:
                responses[i] = pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("LABEL", np.ascontiguousarray(result.labels)),
                        pb_utils.Tensor("CLASS_INDEX", np.ascontiguousarray(result.indices)),
                        pb_utils.Tensor("SCORE", np.ascontiguousarray(result.scores)),
                    ]
                )
        return responses
