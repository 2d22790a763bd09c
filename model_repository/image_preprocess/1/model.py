"""Triton shim for a preprocessing step: IMAGE (JPEG/PNG bytes) -> pixel_values [n, 3, S, S].

The recipe (resize mode, interpolation, mean and std) is the config's parameters."""

import triton_python_backend_utils as pb_utils

from contract.model_config import ModelConfig
from python_backends.image.preprocess import PreprocessOptions, preprocess
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
            self.image = self.config.require("input", "IMAGE", "TYPE_STRING", (1,)).name
            self.config.require("output", "pixel_values", "TYPE_FP32")
            self.options = PreprocessOptions.from_config(self.config)
        except Exception as exc:
            raise load_error(pb_utils, self.config.name, exc) from exc
        freeze_loaded_objects()

    def execute(self, requests):
        responses = []
        for request in requests:
            # Each request is decoded on its own: one bad image fails its request only, and
            # decoding is per image anyway (no batch kernel to feed).
            try:
                check_input_shapes(pb_utils, request, self.config)
                pixels = preprocess(input_numpy(pb_utils, request, self.image), self.image, self.options)
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("pixel_values", pixels)]))
            except Exception as exc:
                responses.append(error_response(pb_utils, self.config.name, exc, request.request_id()))
        return responses
