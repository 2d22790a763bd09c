"""Run a list of Triton requests through one ONNX Runtime session as few times as possible.

Requests whose inputs share trailing shapes run as one concatenated batch. If a batched
run fails (one request with an out-of-range token id, say), each request of that group is
rerun alone so that only the offending request gets the error: a bad request never fails
the requests it was batched with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from python_backends.errors import InputError

log = logging.getLogger(__name__)

Inputs = Mapping[str, np.ndarray]
RunFn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class Outcome:
    outputs: dict[str, np.ndarray] | None = None
    error: Exception | None = None


def _shape_key(inputs: Inputs, names: Sequence[str]) -> tuple:
    return tuple((name, inputs[name].shape[1:], inputs[name].dtype.str) for name in names)


def validate_request(inputs: Inputs, names: Sequence[str]) -> None:
    batch = None
    for name in names:
        if name not in inputs:
            raise InputError(name, "input is missing")
        array = inputs[name]
        if array.ndim < 1:
            raise InputError(name, "expected a batch axis")
        if batch is None:
            batch = array.shape[0]
        elif array.shape[0] != batch:
            raise InputError(name, f"batch size {array.shape[0]} differs from the other inputs' {batch}")


def run_batched(requests: Sequence[Inputs], input_names: Sequence[str], run: RunFn) -> list[Outcome]:
    """Return one Outcome per request, in order."""
    outcomes = [Outcome() for _ in requests]
    groups: dict[tuple, list[int]] = {}
    for i, inputs in enumerate(requests):
        try:
            validate_request(inputs, input_names)
        except InputError as exc:
            outcomes[i].error = exc
            continue
        groups.setdefault(_shape_key(inputs, input_names), []).append(i)

    for members in groups.values():
        try:
            _run_group(requests, members, input_names, run, outcomes)
        except Exception as exc:  # noqa: BLE001 - isolate the failure to the request that caused it
            if len(members) == 1:
                outcomes[members[0]].error = _request_error(exc)
                continue
            log.warning("batched run of %d requests failed (%s); retrying one by one", len(members), exc)
            for i in members:
                try:
                    _run_group(requests, [i], input_names, run, outcomes)
                except Exception as single_exc:  # noqa: BLE001
                    outcomes[i].error = _request_error(single_exc)
    return outcomes


def _request_error(exc: Exception) -> Exception:
    """A request that fails alone with ONNX Runtime's INVALID_ARGUMENT (an input id beyond the
    vocabulary, say: Triton already checked dtypes and shapes) is the client's fault: InputError."""
    if type(exc).__name__ == "InvalidArgument":
        return InputError("inputs", str(exc))
    return exc


def _run_group(requests, members, input_names, run: RunFn, outcomes: list[Outcome]) -> None:
    if len(members) == 1:
        feed = {name: requests[members[0]][name] for name in input_names}
    else:
        feed = {name: np.concatenate([requests[i][name] for i in members], axis=0) for name in input_names}
    results = run(feed)
    sizes = [requests[i][input_names[0]].shape[0] for i in members]
    offsets = np.cumsum([0] + sizes)
    for k, i in enumerate(members):
        outcomes[i].outputs = {name: value[offsets[k] : offsets[k + 1]] for name, value in results.items()}
