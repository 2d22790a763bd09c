"""Triton shim for text_generation: a decoupled model over the paged-KV generation engine.

execute() only validates and hands requests to the engine loop (one background thread
that batches every running stream into each step); the loop sends each request's
responses through its response sender. Everything else is python_backends.generation.
"""

import itertools
import json
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.config import ModelConfig
from python_backends.generation.engine import EngineConfig, EngineLoop, LLMEngine
from python_backends.generation.sampling import SamplingParams
from python_backends.generation.serving import BOOL_INPUTS, ResponseShaper, engine_settings, parse_request
from python_backends.generation.triton_metrics import GenerationMetrics
from python_backends.shim import (
    check_input_shapes,
    error_response,
    freeze_loaded_objects,
    install_logging,
    keep_metrics,
    load_error,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
OUTPUT_TYPES = {"text_output": object, "finish_reason": object, "num_input_tokens": np.uint32, "num_output_tokens": np.uint32}


class TritonPythonModel:
    def initialize(self, args):
        install_logging(pb_utils)
        self.config = ModelConfig(args["model_config"])
        try:
            if not pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
                raise ValueError("text_generation must be decoupled (model_transaction_policy { decoupled: true })")
            self.config.require("input", "text_input", "TYPE_STRING", (1,))
            self.config.require("output", "text_output", "TYPE_STRING", (-1,))
            settings = engine_settings(self.config.param, self.config.param_int, self.config.param_bool)
            gpu = args.get("model_instance_kind") == "GPU"
            device = f"cuda:{args.get('model_instance_device_id', '0')}" if gpu else "cpu"
            if settings["dtype"] == "auto":
                settings["dtype"] = "bfloat16" if gpu else "float32"
            self.max_text_bytes = self.config.param_int("max_text_bytes", 262144, minimum=1)
            version_dir = Path(args["model_repository"]) / args["model_version"]
            self.engine = LLMEngine(EngineConfig(model_dir=version_dir, device=device, **settings))
            # One short generation so the first client does not pay for lazy initialisation.
            self.engine.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0))
            labels = {"model": self.config.name, "version": str(args["model_version"])}
            self.metrics = GenerationMetrics(pb_utils, labels, baseline=self.engine.stats())
            self.loop = EngineLoop(self.engine, on_stats=self.metrics.on_stats)
        except Exception as exc:
            raise load_error(pb_utils, self.config.name, exc) from exc
        self.ids = itertools.count()
        self.instance = f"{args.get('model_instance_name', '')}/pid{os.getpid()}"
        freeze_loaded_objects()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                check_input_shapes(pb_utils, request, self.config)
                inputs = {}
                for name in ("text_input", "sampling_parameters", *BOOL_INPUTS):
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    inputs[name] = None if tensor is None else tensor.as_numpy()
                parsed = parse_request(
                    inputs,
                    json.loads(request.parameters() or "{}"),
                    tokenizer=self.engine.tokenizer,
                    max_tokens_limit=self.engine.config.max_tokens_limit,
                    default_max_tokens=self.engine.config.default_max_tokens,
                    max_text_bytes=self.max_text_bytes,
                )
                shaper = ResponseShaper(parsed)
                self.loop.submit(
                    next(self.ids),
                    parsed.prompt,
                    parsed.params,
                    self._sender_callback(sender, shaper, request.request_id()),
                    is_cancelled=sender.is_cancelled,
                )
            except Exception as exc:  # InputError, QueueFull, ...: their codes pick Triton's (shim.error_response)
                sender.send(error_response(pb_utils, self.config.name, exc, request.request_id()), flags=FINAL)
        return None

    def _sender_callback(self, sender, shaper, request_id):
        name = self.config.name
        metrics = self.metrics

        def on_output(out):
            metrics.on_output(out)
            if out.error is not None:
                sender.send(error_response(pb_utils, name, out.error, request_id), flags=FINAL)
                return
            if out.finish_reason == "abort" and sender.is_cancelled():
                sender.send(flags=FINAL)  # the client is gone: close the stream, nothing to say
                return
            values = shaper.on_output(out.text, out.finished, out.finish_reason, out.num_input_tokens, out.num_output_tokens)
            if values is None:
                if out.finished:
                    sender.send(flags=FINAL)
                return
            tensors = []
            for key, value in values.items():
                if value is None:
                    continue
                if OUTPUT_TYPES[key] is object:
                    array = np.array([str(value).encode("utf-8")], dtype=object)
                else:
                    array = np.array([value], dtype=OUTPUT_TYPES[key])
                tensors.append(pb_utils.Tensor(key, array))
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if out.finished else 0)

        return on_output

    def finalize(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown()
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
            keep_metrics(*metrics.objects())
