"""Run a list of Triton requests through one ONNX Runtime session as few times as possible.

Requests whose inputs share trailing shapes run as one concatenated batch. If a batched
run fails (one request with an out-of-range token id, say), each request of that group is
rerun alone so that only the offending request gets the error: a bad request never fails
the requests it was batched with.

With a token budget (``run_batched(..., budget=TokenBudget(...))``, for a model whose
sequence inputs are declared ``allow_ragged_batch``) requests of any length run together:
each row is trimmed to its real length (from the attention mask), the rows of all requests
are sorted by length and cut into runs of at most ``max_tokens`` padded tokens, each run is
padded to its own longest row, and the results are put back in request order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from contract.errors import ConfigError, InputError

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


@dataclass(frozen=True)
class TokenBudget:
    """Length-aware grouping: at most ``max_tokens`` padded tokens (rows x the run's longest
    row) per run; a row longer than the budget runs alone. ``length_input`` is the attention
    mask a row's real length is read from (the position of its last 1); ``max_rows`` caps the
    rows of one run (0: no cap); ``max_padding`` is how many padding tokens a row may get to
    join a run (0: any): on a CPU a padded token costs about as much as a real one, so rows
    only share a run when the padding costs less than the run it saves."""

    max_tokens: int
    length_input: str = "attention_mask"
    max_rows: int = 0
    pad_value: int = 0
    max_padding: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_rows < 0 or self.max_padding < 0:
            raise ValueError(f"max_rows and max_padding must be >= 0, got {self.max_rows}, {self.max_padding}")


def budget_from_config(config) -> TokenBudget | None:
    """The TokenBudget a config asks for (a contract.model_config.ModelConfig), or None.

    Inputs declared ``allow_ragged_batch: true`` let Triton's batcher merge requests of any
    length; then every input must be ragged, each a [batch, sequence] tensor, no output may
    have a variable dimension (results are put back per row), and ``parameters`` give
    ``max_batch_tokens`` (padded tokens per run) and optionally ``max_row_padding`` (tokens a
    row may be padded by to join a run), ``max_batch_rows`` and ``ragged_length_input`` (the
    attention mask, default ``attention_mask``). Raises ConfigError otherwise.
    """
    ragged = [t["name"] for t in config.raw.get("input", []) if t.get("allow_ragged_batch")]
    if not ragged:
        if config.param("max_batch_tokens") is not None:
            raise ConfigError(f"model {config.name!r}: max_batch_tokens needs inputs with allow_ragged_batch: true")
        return None
    names = [spec.name for spec in config.inputs]
    if sorted(ragged) != sorted(names):
        raise ConfigError(
            f"model {config.name!r}: allow_ragged_batch must be set on every input "
            f"({', '.join(names)}) or none; set on {', '.join(ragged)}"
        )
    for spec in config.inputs:
        if spec.dims != (-1,):
            raise ConfigError(
                f"model {config.name!r}: ragged input {spec.name!r} must have dims [ -1 ], config says {list(spec.dims)}"
            )
    for spec in config.outputs:
        if -1 in spec.dims:
            raise ConfigError(
                f"model {config.name!r}: with ragged inputs, output {spec.name!r} "
                f"cannot have a variable dimension ({list(spec.dims)})"
            )
    if config.param("max_batch_tokens") is None:
        raise ConfigError(f"model {config.name!r}: ragged inputs need parameters max_batch_tokens")
    length_input = config.param("ragged_length_input") or "attention_mask"
    if length_input not in names:
        raise ConfigError(f"model {config.name!r}: ragged_length_input {length_input!r} is not an input ({', '.join(names)})")
    return TokenBudget(
        config.param_int("max_batch_tokens", 0, minimum=1),
        length_input,
        max_rows=config.param_int("max_batch_rows", 0, minimum=0),
        max_padding=config.param_int("max_row_padding", 0, minimum=0),
    )


def row_lengths(mask: np.ndarray) -> np.ndarray:
    """Real length of each row of a [rows, L] attention mask: one past its last nonzero entry,
    at least 1 (an all-zero row keeps one position, so it still runs)."""
    mask = np.asarray(mask)
    if mask.shape[1] == 0:
        return np.ones(mask.shape[0], dtype=np.int64)
    nonzero = mask != 0
    last = mask.shape[1] - np.argmax(nonzero[:, ::-1], axis=1)
    return np.where(nonzero.any(axis=1), last, 1).astype(np.int64)


def plan_runs(lengths: Sequence[int], max_tokens: int, max_rows: int = 0, max_padding: int = 0) -> list[list[int]]:
    """Cut rows (by index into ``lengths``) into runs: longest first, each run padded to its
    first (longest) row and closed before rows x that length exceeds ``max_tokens``, before it
    holds ``max_rows`` rows, or before a row shorter than that length by more than
    ``max_padding`` tokens. A row longer than the budget gets a run of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    runs: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        if current and (
            (len(current) + 1) * width > max_tokens
            or (max_rows and len(current) >= max_rows)
            or (max_padding and width - int(lengths[i]) > max_padding)
        ):
            runs.append(current)
            current = []
        if not current:
            width = int(lengths[i])
        current.append(i)
    if current:
        runs.append(current)
    return runs


def validate_ragged(inputs: Inputs, names: Sequence[str]) -> None:
    """``validate_request`` plus: every ragged input is [rows, length], all of one request alike."""
    validate_request(inputs, names)
    if inputs[names[0]].shape[0] == 0:
        raise InputError(names[0], "a request needs at least one row")
    first = None
    for name in names:
        array = inputs[name]
        if array.ndim != 2:
            raise InputError(name, f"expected [batch, sequence], got shape {list(array.shape)}")
        if first is None:
            first = (name, array.shape)
        elif array.shape != first[1]:
            raise InputError(name, f"shape {list(array.shape)} differs from {first[0]}'s {list(first[1])}")


def run_batched(
    requests: Sequence[Inputs], input_names: Sequence[str], run: RunFn, budget: TokenBudget | None = None
) -> list[Outcome]:
    """Return one Outcome per request, in order (grouped by shape, or under ``budget``)."""
    if budget is not None:
        return _run_ragged(requests, input_names, run, budget)
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


def _run_ragged(requests: Sequence[Inputs], input_names: Sequence[str], run: RunFn, budget: TokenBudget) -> list[Outcome]:
    outcomes = [Outcome() for _ in requests]
    if budget.length_input not in input_names:
        raise ValueError(f"the budget's length input {budget.length_input!r} is not among {list(input_names)}")
    # rows[k] = (request, row within it, real length)
    rows: list[tuple[int, int, int]] = []
    valid: list[int] = []
    for r, inputs in enumerate(requests):
        try:
            validate_ragged(inputs, input_names)
        except InputError as exc:
            outcomes[r].error = exc
            continue
        valid.append(r)
        for j, length in enumerate(row_lengths(inputs[budget.length_input])):
            rows.append((r, j, int(length)))
    results: dict[int, dict[str, np.ndarray]] = {}
    retry: set[int] = set()
    for members in plan_runs([length for _, _, length in rows], budget.max_tokens, budget.max_rows, budget.max_padding):
        picked = [rows[k] for k in members]
        owners = {r for r, _, _ in picked}
        if owners & retry:  # a request already known to fail: run its neighbours without it
            picked = [row for row in picked if row[0] not in retry]
            if not picked:
                continue
        try:
            out = run(_pad_rows(requests, picked, input_names, budget.pad_value))
        except Exception as exc:  # noqa: BLE001 - isolate the failure to the request that caused it
            owners = {r for r, _, _ in picked}
            if len(owners) > 1:
                log.warning(
                    "a run of %d rows from %d requests failed (%s); retrying them one by one", len(picked), len(owners), exc
                )
            retry |= owners
            continue
        for k, (r, j, _) in enumerate(picked):
            if r in retry:
                continue
            store = results.setdefault(r, {})
            for name, value in out.items():
                if name not in store:
                    store[name] = np.empty((requests[r][input_names[0]].shape[0], *value.shape[1:]), value.dtype)
                store[name][j] = value[k]
    for r in valid:
        if r in retry:
            own = [(r, j, int(length)) for j, length in enumerate(row_lengths(requests[r][budget.length_input]))]
            try:
                outcomes[r].outputs = run(_pad_rows(requests, own, input_names, budget.pad_value))
            except Exception as exc:  # noqa: BLE001
                outcomes[r].error = _request_error(exc)
        else:
            outcomes[r].outputs = results.get(r, {})
    return outcomes


def _pad_rows(
    requests: Sequence[Inputs], picked: Sequence[tuple[int, int, int]], input_names: Sequence[str], pad_value: int
) -> dict[str, np.ndarray]:
    """The rows ``picked`` (request, row, length), each cut to its length, in one [n, longest] feed."""
    width = max(length for _, _, length in picked)
    feed = {}
    for name in input_names:
        dtype = requests[picked[0][0]][name].dtype
        array = np.full((len(picked), width), pad_value, dtype=dtype)
        for k, (r, j, length) in enumerate(picked):
            array[k, :length] = requests[r][name][j, :length]
        feed[name] = array
    return feed
