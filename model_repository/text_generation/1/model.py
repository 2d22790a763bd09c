"""Triton shim for text_generation, a decoupled model over the paged-KV generation engine
(python_backends.generation.entry): execute() hands each request to the engine loop, which
answers through the request's response sender."""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from contract.model_config import ModelConfig
from python_backends.generation.entry import INPUT_NAMES, GenerationEntry
from python_backends.generation.triton_metrics import GenerationMetrics
from python_backends.shim import (
    SenderReply,
    check_input_shapes,
    freeze_loaded_objects,
    install_logging,
    keep_metrics,
    load_error,
)


class TritonPythonModel:
    entry = metrics = None

    def initialize(self, args):
        install_logging(pb_utils)
        self.config = ModelConfig(args["model_config"])
        try:
            decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
            gpu = args.get("model_instance_device_id", "0") if args.get("model_instance_kind") == "GPU" else None
            version_dir = Path(args["model_repository"]) / args["model_version"]
            self.entry = GenerationEntry(self.config, version_dir, decoupled=decoupled, gpu_device=gpu)
            labels = {"model": self.config.name, "version": str(args["model_version"])}
            self.metrics = GenerationMetrics(pb_utils, labels, baseline=self.entry.engine.stats())
            self.entry.start(on_stats=self.metrics.on_stats, on_output=self.metrics.on_output)
        except Exception as exc:
            raise load_error(pb_utils, self.config.name, exc) from exc
        freeze_loaded_objects()

    def execute(self, requests):
        for request in requests:
            reply = SenderReply(pb_utils, request.get_response_sender(), self.config.name, request.request_id())
            try:
                check_input_shapes(pb_utils, request, self.config)
                inputs = {}
                for name in INPUT_NAMES:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    inputs[name] = None if tensor is None else tensor.as_numpy()
                self.entry.submit(inputs, json.loads(request.parameters() or "{}"), reply)
            except Exception as exc:  # InputError, QueueFull, ...: their codes pick Triton's (shim.error_response)
                reply.fail(exc)
        return None

    def finalize(self):
        if self.entry is not None:
            self.entry.close()
        if self.metrics is not None:
            self.metrics.close()
            keep_metrics(*self.metrics.objects())
