"""The priority classes, their latency budgets, and how a request names its class.

A class is served by its own entry model and lane (text_embedding_cached_interactive ->
text_embedding_interactive -> text_encoder_interactive; default and bulk share the default
lane), so each class has its own Triton queue: tritonserver 2.51's own priority queue stalls
its batcher (docs/performance.md), and a Python step answers a whole batch at once, so a
request of one class must never share a batch with another's. The request parameter
``priority_class`` is optional; when given it must name the entry's own class.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.errors import InputError

PARAMETER = "priority_class"


@dataclass(frozen=True)
class PriorityClass:
    name: str
    budget_ms: int  # the P99 this class is designed to keep under overload


# The seed articles' table: payments 50 ms, monitoring 200 ms, logs 1,000 ms.
CLASSES = {
    "interactive": PriorityClass("interactive", 50),
    "default": PriorityClass("default", 200),
    "bulk": PriorityClass("bulk", 1000),
}


# The entry model of each class for texts (the cached entry) and its lane (the ensemble its
# misses go to); the OpenAI gateway picks by the same table.
CACHED_ENTRIES = {
    "interactive": "text_embedding_cached_interactive",
    "default": "text_embedding_cached",
    "bulk": "text_embedding_cached_bulk",
}
DIRECT_ENTRIES = {
    "interactive": "text_embedding_interactive",
    "default": "text_embedding",
    "bulk": "text_embedding",
}


def class_named(name: str, field: str = PARAMETER) -> PriorityClass:
    """The class called ``name``; InputError naming ``field`` and the choices otherwise."""
    if not isinstance(name, str) or name not in CLASSES:
        shown = repr(name)[:64]
        raise InputError(field, f"unknown priority class {shown}; expected one of {', '.join(CLASSES)}")
    return CLASSES[name]


def check_request_class(parameters: str | dict | None, own: PriorityClass, entries: dict[str, str] = CACHED_ENTRIES) -> None:
    """Refuse a request whose ``priority_class`` parameter names another class than the
    entry's own, naming the entry model that serves it (``entries``: class -> model).
    ``parameters``: the request's parameters, as a dict or as python_backend's JSON string."""
    if isinstance(parameters, str):
        if PARAMETER not in parameters:  # the common case, "{}": no parse
            return
        import json

        try:
            parameters = json.loads(parameters)
        except ValueError:
            return
    if not isinstance(parameters, dict) or PARAMETER not in parameters:
        return
    wanted = class_named(parameters[PARAMETER])
    if wanted.name != own.name:
        where = entries.get(wanted.name)
        hint = f"; send it to model {where}" if where else ""
        raise InputError(PARAMETER, f"this entry serves class {own.name!r}, not {wanted.name!r}{hint}")
