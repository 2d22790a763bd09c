"""Triton shim for text_embedding_cached and its priority-class entries (the _interactive and
_bulk models link this file); the cache, admission and identity are python_backends.cache.entry."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from contract.errors import error_from_message
from contract.truncation import DIRECTION_INPUT, TRUNCATE_INPUT
from python_backends.admission.classes import PARAMETER as CLASS_PARAMETER
from python_backends.cache.entry import CachedEntry
from python_backends.cache.triton_metrics import CacheMetrics
from python_backends.shim import apply_process_nice
from python_backends.shim_base import BatchShim, request_texts, request_truncation


class TritonPythonModel(BatchShim):
    pb_utils = pb_utils
    entry = metrics = None

    def load(self, args):
        apply_process_nice(self.config)
        repository = Path(args["model_repository"]).parent
        self.entry = CachedEntry(self.config, repository, pb_utils.is_model_ready, self._compute)
        self.metrics = CacheMetrics(pb_utils, self.config.name, args.get("model_instance_name", ""))
        self.entry.use_metrics(self.metrics)

    def _compute(self, texts, options):
        """ONE batched BLS call to the target model for all of a batch's misses, each truncated
        as its Truncation says (a refused text: the target's error, whose data the entry reads)."""
        request = pb_utils.InferenceRequest(
            model_name=self.entry.target,
            requested_output_names=["EMBEDDING", "NUM_TOKENS"],
            inputs=[
                pb_utils.Tensor("TEXT", np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)),
                pb_utils.Tensor(TRUNCATE_INPUT, np.array([[o.truncate] for o in options], dtype=np.bool_)),
                pb_utils.Tensor(DIRECTION_INPUT, np.array([[o.direction.encode()] for o in options], dtype=np.object_)),
            ],
            parameters={CLASS_PARAMETER: self.entry.cls.name},  # the class, carried through the BLS hop
        )
        response = request.exec()
        if response.has_error():
            raise error_from_message(response.error().message(), f"{self.entry.target} failed: ")
        out = (pb_utils.get_output_tensor_by_name(response, name) for name in ("EMBEDDING", "NUM_TOKENS"))
        return tuple(t.as_numpy() for t in out)

    def decode(self, request):
        self.entry.check_class(request.parameters())  # a request naming another class is answered here
        texts = request_texts(pb_utils, request, self.entry.text, self.entry.max_text_bytes, self.config)
        return texts, request_truncation(pb_utils, request, len(texts), self.entry.truncate)

    def run(self, decoded):
        batch = list(decoded.values())
        return zip(decoded, self.entry.embed([texts for texts, _ in batch], [options for _, options in batch]))

    def encode(self, rows):
        vectors, counts = rows
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("EMBEDDING", np.ascontiguousarray(vectors)),
                pb_utils.Tensor("NUM_TOKENS", counts.reshape(-1, 1)),
            ]
        )

    def close(self):
        if self.entry is not None:
            self.entry.close()

    def metric_objects(self):
        return self.metrics.objects() if self.metrics is not None else []
