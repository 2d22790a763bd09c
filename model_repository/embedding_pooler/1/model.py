"""Triton shim for the pooling step: token_embeddings, attention_mask -> EMBEDDING (masked mean, L2)."""

import triton_python_backend_utils as pb_utils

from python_backends.config import ModelConfig
from python_backends.shim import error_response, input_numpy, install_logging, load_error
from python_backends.text.pooling import mean_pool


class TritonPythonModel:
    def initialize(self, args):
        install_logging(pb_utils)
        self.config = ModelConfig(args["model_config"])
        try:
            hidden = self.config.require("output", "EMBEDDING", "TYPE_FP32").dims
            self.config.require("input", "token_embeddings", "TYPE_FP32", (-1,) + hidden)
            self.config.require("input", "attention_mask", "TYPE_INT64", (-1,))
            self.normalize = self.config.param_bool("normalize", True)
        except Exception as exc:
            raise load_error(pb_utils, self.config.name, exc)

    def execute(self, requests):
        responses = []
        for request in requests:
            # Requests differ in sequence length, so each is pooled on its own; this is cheap
            # numpy work next to the encoder.
            try:
                pooled = mean_pool(
                    input_numpy(pb_utils, request, "token_embeddings"),
                    input_numpy(pb_utils, request, "attention_mask"),
                    normalize=self.normalize,
                )
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("EMBEDDING", pooled)]))
            except Exception as exc:
                responses.append(error_response(pb_utils, self.config.name, exc, request.request_id()))
        return responses
