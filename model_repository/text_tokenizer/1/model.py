"""Triton shim for the tokenizer step: TEXT -> input_ids, attention_mask (one tokenizer call per batch)."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.config import ModelConfig
from python_backends.padding_metrics import PaddingMetrics, batches_counts
from python_backends.shim import (
    decode_text_requests,
    error_response,
    freeze_loaded_objects,
    install_logging,
    keep_metrics,
    load_error,
)
from python_backends.text.tokenization import DEFAULT_BUCKETS, BatchTokenizer


class TritonPythonModel:
    def initialize(self, args):
        install_logging(pb_utils)
        self.config = ModelConfig(args["model_config"])
        try:
            self.text = self.config.require("input", "TEXT", "TYPE_STRING", (1,)).name
            self.config.require("output", "input_ids", "TYPE_INT64", (-1,))
            self.config.require("output", "attention_mask", "TYPE_INT64", (-1,))
            version_dir = Path(args["model_repository"]) / args["model_version"]
            self.max_text_bytes = self.config.param_int("max_text_bytes", 65536, minimum=1)
            self.tokenizer = BatchTokenizer(
                version_dir / (self.config.param("tokenizer_file") or "tokenizer.json"),
                max_length=self.config.param_int("max_sequence_length", 256, minimum=1),
                buckets=self.config.param_int_list("sequence_buckets", DEFAULT_BUCKETS),
            )
        except Exception as exc:
            raise load_error(pb_utils, self.config.name, exc) from exc
        # Off only to measure what the metrics cost (perf/bench/metrics_cost.py).
        self.metrics = None
        if self.config.param_bool("metrics", True):
            self.metrics = PaddingMetrics(pb_utils, self.config.name, args["model_version"], batch_histogram=True)
        freeze_loaded_objects()

    def execute(self, requests):
        # owners[k] = (request index, start, stop) into texts; bad requests already answered
        responses, texts, owners = decode_text_requests(
            pb_utils, self.config.name, requests, self.text, self.max_text_bytes, config=self.config
        )
        encoded = []
        if owners:
            # One tokenizer call; if it raises, one per request (only the offender fails).
            encoded = self.tokenizer.encode_requests(texts, [(start, stop) for _, start, stop in owners])
            for (i, _, _), batch in zip(owners, encoded):
                if isinstance(batch, Exception):
                    responses[i] = error_response(pb_utils, self.config.name, batch, requests[i].request_id())
                    continue
                responses[i] = pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("input_ids", np.ascontiguousarray(batch.input_ids)),
                        pb_utils.Tensor("attention_mask", np.ascontiguousarray(batch.attention_mask)),
                    ]
                )
        if self.metrics:
            self.metrics.record(*batches_counts(encoded), requests=len(requests))
        return responses

    def finalize(self):
        if self.metrics:
            self.metrics.close()
            keep_metrics(*self.metrics.objects())  # never deleted: see keep_metrics
