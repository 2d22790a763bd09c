"""Triton shim for the reranker's tokenizer step: QUERY, DOCUMENTS -> input_ids, attention_mask,
token_type_ids, num_tokens, one row per (query, document) pair (python_backends.text.pairs)."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from contract.errors import InputError
from python_backends.shim import input_numpy
from python_backends.shim_base import BatchShim, request_texts
from python_backends.text.pairs import DEFAULT_PAIR_BUCKETS, PairTokenizer


class TritonPythonModel(BatchShim):
    pb_utils = pb_utils

    def load(self, args):
        self.query = self.config.require("input", "QUERY", "TYPE_STRING", (1,)).name
        self.documents = self.config.require("input", "DOCUMENTS", "TYPE_STRING", (-1,)).name
        for name in ("input_ids", "attention_mask", "token_type_ids"):
            self.config.require("output", name, "TYPE_INT64", (-1, -1))
        self.config.require("output", "num_tokens", "TYPE_INT32", (-1,))
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.max_text_bytes = self.config.param_int("max_text_bytes", 65536, minimum=1)
        self.max_documents = self.config.param_int("max_documents", 64, minimum=1)
        self.tokenizer = PairTokenizer(
            version_dir / (self.config.param("tokenizer_file") or "tokenizer.json"),
            max_length=self.config.param_int("max_sequence_length", 512, minimum=1),
            buckets=self.config.param_int_list("sequence_buckets", DEFAULT_PAIR_BUCKETS),
            truncation=self.config.param("truncation", "refuse"),
        )

    def decode(self, request):
        # Shapes first (check_input_shapes), then each text; the count before any text is read.
        (query,) = request_texts(pb_utils, request, self.query, self.max_text_bytes, self.config)
        count = input_numpy(pb_utils, request, self.documents).size
        if count > self.max_documents:
            raise InputError(
                self.documents,
                f"{count} documents; the limit is {self.max_documents} per request",
                values={"documents": count, "limit": self.max_documents},
            )
        return query, request_texts(pb_utils, request, self.documents, self.max_text_bytes)

    def run(self, decoded):
        for i, (query, documents) in decoded.items():
            try:
                yield i, self.tokenizer.encode(query, documents, self.query, self.documents)
            except Exception as exc:  # noqa: BLE001 - this request's error only
                yield i, exc

    def encode(self, pairs):
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("input_ids", np.ascontiguousarray(pairs.input_ids)),
                pb_utils.Tensor("attention_mask", np.ascontiguousarray(pairs.attention_mask)),
                pb_utils.Tensor("token_type_ids", np.ascontiguousarray(pairs.token_type_ids)),
                pb_utils.Tensor("num_tokens", pairs.num_tokens),
            ]
        )
