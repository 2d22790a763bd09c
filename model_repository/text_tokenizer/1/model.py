"""Triton shim for the tokenizer step: TEXT (and the optional TRUNCATE, TRUNCATION_DIRECTION)
-> input_ids, attention_mask, num_tokens (one tokenizer call per batch;
python_backends.text.tokenization and .truncation)."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from contract.truncation import DIRECTION_INPUT, TRUNCATE_INPUT
from python_backends.padding_metrics import PaddingMetrics, batches_counts
from python_backends.shim_base import BatchShim, request_texts, request_truncation
from python_backends.text.tokenization import DEFAULT_BUCKETS, BatchTokenizer


class TritonPythonModel(BatchShim):
    pb_utils = pb_utils
    metrics = None

    def load(self, args):
        self.text = self.config.require("input", "TEXT", "TYPE_STRING", (1,)).name
        self.config.require("input", TRUNCATE_INPUT, "TYPE_BOOL", (1,))
        self.config.require("input", DIRECTION_INPUT, "TYPE_STRING", (1,))
        self.config.require("output", "input_ids", "TYPE_INT64", (-1,))
        self.config.require("output", "attention_mask", "TYPE_INT64", (-1,))
        self.config.require("output", "num_tokens", "TYPE_INT32", (1,))
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.max_text_bytes = self.config.param_int("max_text_bytes", 65536, minimum=1)
        self.truncate = self.config.param_bool("truncate", False)  # TRUNCATE when a request leaves it out
        self.tokenizer = BatchTokenizer(
            version_dir / (self.config.param("tokenizer_file") or "tokenizer.json"),
            max_length=self.config.param_int("max_sequence_length", 256, minimum=1),
            buckets=self.config.param_int_list("sequence_buckets", DEFAULT_BUCKETS),
        )
        # Off only to measure what the metrics cost (python -m perf.bench.overhead metrics).
        if self.config.param_bool("metrics", True):
            self.metrics = PaddingMetrics(pb_utils, self.config.name, args["model_version"], batch_histogram=True)

    def decode(self, request):
        texts = request_texts(pb_utils, request, self.text, self.max_text_bytes, self.config)
        return texts, request_truncation(pb_utils, request, len(texts), self.truncate)

    def run(self, decoded):
        texts, options, spans = [], [], []
        for one, truncation in decoded.values():
            spans.append((len(texts), len(texts) + len(one)))
            texts.extend(one)
            options.extend(truncation)
        # One tokenizer call; if it raises, one per request (only the offender fails); a text
        # over the limit without TRUNCATE fails its own request.
        encoded = self.tokenizer.encode_requests(texts, spans, options) if spans else []
        if self.metrics:
            self.metrics.record(*batches_counts(encoded), requests=self.batch_size)
        return zip(decoded, encoded)

    def encode(self, batch):
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("input_ids", np.ascontiguousarray(batch.input_ids)),
                pb_utils.Tensor("attention_mask", np.ascontiguousarray(batch.attention_mask)),
                pb_utils.Tensor("num_tokens", batch.num_tokens.reshape(-1, 1)),
            ]
        )

    def metric_objects(self):
        return self.metrics.objects() if self.metrics is not None else []
