"""Triton shim for text_embedding_cached and its priority-class entries (the _interactive and
_bulk models link this file): L1/L2 lookups, admission, one BLS call for the misses."""

import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.admission.classes import PARAMETER as CLASS_PARAMETER
from python_backends.admission.classes import check_request_class, class_named
from python_backends.admission.controller import Admission
from python_backends.admission.inflight import SharedInflight, default_directory
from python_backends.cache.identity import IdentityResolver
from python_backends.cache.keys import KeyMaker
from python_backends.cache.lru import LRUCache
from python_backends.cache.redis_l2 import RedisL2
from python_backends.cache.settings import CacheSettings
from python_backends.cache.tiered import EmbeddingCache
from python_backends.cache.triton_metrics import CacheMetrics
from python_backends.config import ModelConfig
from python_backends.shim import (
    apply_process_nice,
    decode_text_requests,
    error_response,
    freeze_loaded_objects,
    install_logging,
    keep_metrics,
    load_error,
)


class TritonPythonModel:
    def initialize(self, args):
        install_logging(pb_utils)
        self.config = ModelConfig(args["model_config"])
        try:
            apply_process_nice(self.config)
            self.text = self.config.require("input", "TEXT", "TYPE_STRING", (1,)).name
            out = self.config.require("output", "EMBEDDING", "TYPE_FP32")
            if len(out.dims) != 1 or out.dims[0] < 1:
                raise ValueError(f"output EMBEDDING must have dims [d], config says {list(out.dims)}")
            self.dim = out.dims[0]
            self.target = self.config.param("target_model", "text_embedding")
            self.max_text_bytes = self.config.param_int("max_text_bytes", 65536, minimum=1)
            # The class this entry serves and its admission into the lane (docs/priority-classes.md).
            self.cls = class_named(self.config.param("priority_class", "default"), "parameter priority_class")
            limit = self.config.param_int("admission_rows", 128, minimum=1)
            self.admission = Admission(self.cls, SharedInflight(default_directory(), self.cls.name, limit))
            # A flood is refused only while an instance is free to refuse it: the instances that
            # can wait in the lane with full batches must hold more than the limit.
            if limit > (self.config.instance_count() - 1) * max(1, self.config.max_batch_size):
                pb_utils.Logger.log_warn(
                    f"{self.config.name}: admission_rows {limit} >= (instances - 1) x max_batch_size: "
                    f"a flood queues instead of being refused (docs/priority-classes.md)"
                )
            settings = CacheSettings.from_config(self.config, os.environ)
            self.resolver = IdentityResolver(
                Path(args["model_repository"]).parent,
                self.target,
                self.config.param("encoder_model", "text_encoder"),
                None,
                pb_utils.is_model_ready,
            )
            l1 = LRUCache(settings.l1_max_bytes, settings.l1_ttl_s)
            l2 = None
            if settings.l2_redis_url:
                l2 = RedisL2(
                    settings.l2_redis_url,
                    self.dim,
                    settings.l2_ttl_s,
                    settings.l2_timeout_s,
                    settings.l2_retry_interval_s,
                    settings.warn_interval_s,
                )
            self.cache = EmbeddingCache(self.dim, l1, l2)
            self.metrics = CacheMetrics(pb_utils, self.config.name, args.get("model_instance_name", ""))
            self.metrics.sync(l1, l2)
            self._keys = None
        except Exception as exc:
            raise load_error(pb_utils, self.config.name, exc) from exc
        freeze_loaded_objects()

    def _key_maker(self, version=None):
        """The one place the key's model identity comes from (``version``: a caller's choice)."""
        identity = self.resolver.identity(version)
        if identity is None:
            return None
        if self._keys is None or self._keys.identity != identity:
            self._keys = KeyMaker(identity)
        return self._keys

    def _compute(self, texts):
        """ONE batched BLS call to the target model for all of a batch's misses."""
        batch = np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)
        request = pb_utils.InferenceRequest(
            model_name=self.target,
            requested_output_names=["EMBEDDING"],
            inputs=[pb_utils.Tensor("TEXT", batch)],
            parameters={CLASS_PARAMETER: self.cls.name},  # the class, carried through the BLS hop
        )
        with self.admission.rows(len(texts)):
            response = request.exec()
        if response.has_error():
            raise RuntimeError(f"{self.target} failed: {response.error().message()}")
        return pb_utils.get_output_tensor_by_name(response, "EMBEDDING").as_numpy()

    def execute(self, requests):
        # A request naming another class is answered here (the entry that serves it is named).
        refused = {}
        for i, request in enumerate(requests):
            try:
                check_request_class(request.parameters(), self.cls)
            except Exception as exc:
                refused[i] = error_response(pb_utils, self.config.name, exc, request.request_id())
        if refused:
            kept = [i for i in range(len(requests)) if i not in refused]
            answered = self._execute([requests[i] for i in kept])
            out = [refused.get(i) for i in range(len(requests))]
            for i, response in zip(kept, answered):
                out[i] = response
            return out
        return self._execute(requests)

    def _execute(self, requests):
        if not requests:
            return []
        # owners[k] = (request index, start, stop) into texts; bad requests already answered
        responses, texts, owners = decode_text_requests(
            pb_utils, self.config.name, requests, self.text, self.max_text_bytes, config=self.config
        )
        if not owners:
            return responses

        keys = self._key_maker()
        failure = None
        if keys is None:  # the encoder is not ready: no identity, so no cache; the model answers
            try:
                vectors = self._compute(texts)
            except Exception as exc:
                failure = exc
                vectors = None
            for i, start, stop in owners:
                responses[i] = self._respond(vectors[start:stop] if vectors is not None else None, failure, requests[i])
            return responses

        plan = self.cache.plan(texts, [keys(t) for t in texts])
        if plan.miss_texts:
            try:
                vectors = self._compute(plan.miss_texts)
                # Written back only if the identity did not change during the call (a hot swap
                # in between could have computed them with the new model under the old keys).
                after = self._key_maker()
                self.cache.fill(plan, vectors, store=after is not None and after.identity == keys.identity)
                self.metrics.model_computed(len(plan.miss_texts))
            except Exception as exc:
                failure = exc
        self.metrics.record(plan.counts, self.cache.l1, self.cache.l2)
        for i, start, stop in owners:
            # Requests answered entirely from cache succeed even when the model call failed.
            responses[i] = self._respond(plan.rows(start, stop, self.dim), failure, requests[i])
        return responses

    def _respond(self, rows, failure, request):
        if rows is None:
            exc = failure or RuntimeError("no embedding was produced")
            return error_response(pb_utils, self.config.name, exc, request.request_id())
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("EMBEDDING", np.ascontiguousarray(rows))])

    def finalize(self):
        if getattr(self, "cache", None) is not None and self.cache.l2 is not None:
            self.cache.l2.close()
        if getattr(self, "metrics", None) is not None:
            keep_metrics(*self.metrics.objects())  # never deleted: see keep_metrics
