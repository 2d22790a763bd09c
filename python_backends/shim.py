"""The only place that knows Triton's Python API, passed in as ``pb_utils``.

The library modules never import ``triton_python_backend_utils``; the model.py shims call
these helpers with the module they were given, so everything else is unit-tested without
a server.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from contract.errors import TRITON_CODES, ConfigError, InputError, RequestError, format_error


class _TritonLogHandler(logging.Handler):
    def __init__(self, pb_utils: Any):
        super().__init__()
        self._logger = pb_utils.Logger

    def emit(self, record: logging.LogRecord) -> None:
        message = self.format(record)
        if record.levelno >= logging.ERROR:
            self._logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            self._logger.log_warn(message)
        elif record.levelno >= logging.INFO:
            self._logger.log_info(message)
        else:
            self._logger.log_verbose(message)


def install_logging(pb_utils: Any, level: int = logging.INFO) -> None:
    """Route the library's ``logging`` records to Triton's log (once per process)."""
    root = logging.getLogger("python_backends")
    if not any(isinstance(h, _TritonLogHandler) for h in root.handlers):
        handler = _TritonLogHandler(pb_utils)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(level)
        root.propagate = False


def load_error(pb_utils: Any, model: str, exc: BaseException) -> Exception:
    """The exception to raise from ``initialize`` so the load fails with a clear message."""
    if isinstance(exc, ConfigError):
        return pb_utils.TritonModelException(f"{model}: {exc}")
    return pb_utils.TritonModelException(f"{model}: failed to load: {exc}\n{traceback.format_exc()}")


def error_response(pb_utils: Any, model: str, exc: BaseException, request_id: str = "") -> Any:
    """One request's error response: the Triton code of the error's code, and its data in the
    message (contract.errors.format_error); unexpected errors are logged."""
    if isinstance(exc, RequestError):
        prefix = "" if isinstance(exc, InputError) else f"{model}: "
        code = getattr(pb_utils.TritonError, TRITON_CODES[exc.code])
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(format_error(exc, prefix), code))
    logging.getLogger("python_backends.shim").error(
        "model %s request %r failed: %s", model, request_id or "-", "".join(traceback.format_exception(exc))
    )
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(format_error(exc, f"{model}: "), pb_utils.TritonError.INTERNAL))


class SenderReply:
    """A decoupled request's response sender as a reply: ``send`` the arrays of one response
    (``final``: the last), ``fail`` with an error (its code and data, error_response), ``close``
    the stream with nothing more to say."""

    def __init__(self, pb_utils: Any, sender: Any, model: str, request_id: str = ""):
        self.pb_utils, self.sender, self.model, self.request_id = pb_utils, sender, model, request_id
        self.is_cancelled = sender.is_cancelled
        self.final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def send(self, arrays: dict, final: bool) -> None:
        tensors = [self.pb_utils.Tensor(name, array) for name, array in arrays.items()]
        self.sender.send(self.pb_utils.InferenceResponse(output_tensors=tensors), flags=self.final if final else 0)

    def fail(self, error: BaseException) -> None:
        self.sender.send(error_response(self.pb_utils, self.model, error, self.request_id), flags=self.final)

    def close(self) -> None:
        self.sender.send(flags=self.final)


def keep_metrics(*objects: Any) -> None:
    """Keep ``pb_utils`` Metric and MetricFamily objects alive until the process exits: call it
    from ``finalize`` with every one the model made.

    Their destructors must never run. python_backend r24.10 deletes the model in ``~Stub``,
    after its IPC state is gone: each destructor then reaches a fresh, empty Stub and the stub
    segfaults (kernel log: ``segfault at 60``, one per instance at every unload). Deleting them
    earlier, in ``finalize``, is worse: tritonserver 2.51 counts a series' users per
    MetricFamily object, yet families of one name (a model's instances, the old and the new
    model during a reload) share the series of equal labels, so the first delete frees a series
    another family still updates (heap corruption, the server aborts). Kept, the series stay on
    the metrics port, as they always did, and counters go on across reloads.
    """
    import ctypes

    for obj in objects:
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # one reference nothing releases


def input_numpy(pb_utils: Any, request: Any, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise InputError(name, "input is missing")
    return tensor.as_numpy()


def check_shape(name: str, shape, dims, max_batch_size: int, size: int | None = None) -> None:
    """Raise InputError unless a tensor's shape fits its config: the batch axis (when the model
    batches) between 1 and ``max_batch_size``, then exactly the config's ``dims`` (-1 = any), and,
    when ``size`` (the element count received) is given, a product equal to it.

    tritonserver 2.51 truncates a declared batch to 32 bits: a request declaring 2^40 rows arrives
    with the batch axis gone (batch 0), and one declaring 2^32 + k arrives as k rows.
    """
    shape = [int(d) for d in shape]
    dims = [int(d) for d in dims]
    expected = len(dims) + (1 if max_batch_size > 0 else 0)
    if len(shape) != expected:
        raise InputError(
            name,
            f"shape {shape} has {len(shape)} dimensions; expected {expected} ({'batch + ' if max_batch_size > 0 else ''}{dims})",
        )
    if max_batch_size > 0 and not 1 <= shape[0] <= max_batch_size:
        raise InputError(name, f"batch size {shape[0]} outside 1..{max_batch_size}")
    for axis, (got, want) in enumerate(zip(shape[expected - len(dims) :], dims)):
        # A variable dimension of 0 (an empty sequence) fails inside the model (a 500), not here.
        if got < (1 if want < 0 else 0) or (want >= 0 and got != want):
            raise InputError(name, f"dimension {axis} is {got}; the model expects {want if want >= 0 else 'at least 1'}")
    if size is not None:
        declared = 1
        for d in shape:
            declared *= d
        if declared != size:
            raise InputError(name, f"shape {shape} declares {declared} elements; {size} received")


def check_input_shapes(pb_utils: Any, request: Any, config: Any) -> None:
    """Check every input a request carries against ``config`` (a contract.model_config.ModelConfig)
    with check_shape; call it per request, before the request joins a batch."""
    for spec in config.inputs:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        if tensor is not None:
            check_shape(spec.name, tensor.shape(), spec.dims, config.max_batch_size)


def apply_process_nice(config: Any) -> int:
    """Lower this stub process's CPU priority by the config parameter ``process_nice`` (0-19;
    every thread, so the ONNX Runtime threads created afterwards inherit it): a lower class's
    lane yields the CPU to a higher one's when both run on the same cores
    (docs/priority-classes.md). Raising priority needs privileges, so only lowering is offered.
    The native backends in NVIDIA's container ignore the parameter."""
    import os

    value = config.param_int("process_nice", 0, minimum=0)
    if value > 19:
        raise ConfigError(f"model {config.name!r}: parameter 'process_nice' must be 0-19, got {value}")
    if value:
        for tid in os.listdir("/proc/self/task"):
            try:
                current = os.getpriority(os.PRIO_PROCESS, int(tid))
                os.setpriority(os.PRIO_PROCESS, int(tid), max(current, value))
            except OSError:
                pass
    return value


def freeze_loaded_objects() -> int:
    """Call last in ``initialize``: collect, then move every object alive into the collector's
    permanent generation (``gc.freeze``). Modules, tokenizers, sessions and configs live as long as
    the stub, yet each full collection walks them all; in a stub under load those collections
    took 12-20 ms, stalling every request of that moment. Frozen objects are never collected
    (nothing loaded is meant to be); what requests allocate is collected as before.
    Returns how many objects were frozen."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
