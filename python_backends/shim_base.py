"""A model.py's lifecycle written once: initialize -> decode each request -> run the batch ->
encode each result -> finalize (the shape of PyTriton's proxy model and LitServe's api).

A model.py subclasses ``BatchShim`` (or ``AsyncBatchShim``) as ``TritonPythonModel``, sets
``pb_utils`` to the module Triton gave it and fills in the parts; Triton itself is reached
only through ``python_backends.shim``'s helpers, so the lifecycle is unit-tested with a fake.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from contract.model_config import ModelConfig
from python_backends.shim import (
    check_input_shapes,
    error_response,
    freeze_loaded_objects,
    input_numpy,
    install_logging,
    keep_metrics,
    load_error,
)


def decode_requests(pb_utils: Any, model: str, requests: list, decode: Callable[[Any], Any]) -> tuple[list, dict]:
    """The decode step of a batch: ``decode(request)`` for each request, in order.

    Returns (responses, decoded): responses[i] is the error response of a request ``decode``
    raised for, else None; decoded[i] is what ``decode`` returned for each good request (in
    request order). The bad requests are answered; the good ones go on to the batch.
    """
    responses: list = [None] * len(requests)
    decoded: dict = {}
    for i, request in enumerate(requests):
        try:
            decoded[i] = decode(request)
        except Exception as exc:
            responses[i] = error_response(pb_utils, model, exc, request.request_id())
    return responses, decoded


def encode_results(
    pb_utils: Any, model: str, requests: list, responses: list, results: Iterable, encode: Callable[[Any], Any]
) -> list:
    """The encode step: for each (request index, result) of ``results``, responses[i] becomes
    ``encode(result)``, or the error response when the result is an exception. Returns
    ``responses``."""
    for i, result in results:
        if isinstance(result, Exception):
            responses[i] = error_response(pb_utils, model, result, requests[i].request_id())
        else:
            responses[i] = encode(result)
    return responses


def request_texts(pb_utils: Any, request: Any, name: str, max_bytes: int, config: Any = None) -> list:
    """One request's texts from its ``name`` input (InputError when they cannot be decoded); with
    ``config``, the request's shapes are checked against it first (check_input_shapes)."""
    from python_backends.text.tokenization import decode_texts

    if config is not None:
        check_input_shapes(pb_utils, request, config)
    return decode_texts(input_numpy(pb_utils, request, name), name, max_bytes)


def request_truncation(pb_utils: Any, request: Any, rows: int, default: bool = False) -> list:
    """Each of a request's ``rows`` texts' Truncation from its optional TRUNCATE and
    TRUNCATION_DIRECTION inputs (contract.truncation; InputError for a bad value); without
    TRUNCATE, ``default`` (the model's ``truncate`` parameter)."""
    from contract.truncation import DIRECTION_INPUT, TRUNCATE_INPUT, parse_truncation

    def optional(name: str):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return parse_truncation(optional(TRUNCATE_INPUT), optional(DIRECTION_INPUT), rows, default)


class BatchShim:
    """- initialize: logging, ``self.config`` (the parsed config), ``load(args)``, whose
      exception fails the load naming the model, then freeze_loaded_objects;
    - execute: ``decode(request)`` for each request (one that raises gets its own error
      response), ``run(decoded)`` once for the batch, ``encode(result)`` for each result (an
      exception gets its request's error response): exactly one response per request;
    - finalize: ``close()``, then keep_metrics of ``metric_objects()``.
    """

    pb_utils: Any = None  # triton_python_backend_utils, set by the subclass

    def load(self, args: dict) -> None:
        """Check ``self.config`` and build the library objects; raise to fail the load."""

    def decode(self, request: Any) -> Any:
        """One request's input for the batch; raise (InputError) to fail this request only."""
        raise NotImplementedError

    def run(self, decoded: dict) -> Iterable:
        """{request index: decoded input} (possibly empty) -> (request index, result or
        exception) pairs, one per entry of ``decoded``."""
        raise NotImplementedError

    def encode(self, result: Any) -> Any:
        """One request's InferenceResponse for its result."""
        raise NotImplementedError

    def close(self) -> None:
        """What finalize releases first."""

    def metric_objects(self) -> list:
        """Every pb_utils Metric and MetricFamily the model made (never deleted: keep_metrics)."""
        return []

    def initialize(self, args: dict) -> None:
        install_logging(self.pb_utils)
        self.config = ModelConfig(args["model_config"])
        try:
            self.load(args)
        except Exception as exc:
            raise load_error(self.pb_utils, self.config.name, exc) from exc
        freeze_loaded_objects()

    def execute(self, requests: list) -> list:
        self.batch_size = len(requests)  # for run(): the execution's requests, refused ones included
        responses, decoded = decode_requests(self.pb_utils, self.config.name, requests, self.decode)
        return encode_results(self.pb_utils, self.config.name, requests, responses, self.run(decoded), self.encode)

    def finalize(self) -> None:
        self.close()
        keep_metrics(*self.metric_objects())


class AsyncBatchShim(BatchShim):
    """BatchShim whose ``run`` is a coroutine: Triton awaits an ``async def execute``, so a batch
    can wait on several BLS calls at once (``InferenceRequest.async_exec``)."""

    async def execute(self, requests: list) -> list:  # type: ignore[override]  # Triton awaits a coroutine execute
        self.batch_size = len(requests)
        responses, decoded = decode_requests(self.pb_utils, self.config.name, requests, self.decode)
        results = await self.run(decoded)  # type: ignore[misc]  # run is a coroutine in this class
        return encode_results(self.pb_utils, self.config.name, requests, responses, results, self.encode)
