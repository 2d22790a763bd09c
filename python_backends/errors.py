"""Exceptions shared by the backends. The shims map them to Triton error codes."""

from __future__ import annotations


class ConfigError(ValueError):
    """The model configuration or its files are wrong: the model must fail to load."""


class InputError(ValueError):
    """One request's input is invalid. Only that request fails (Triton INVALID_ARG)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class Overloaded(RuntimeError):
    """The request's class has no capacity left now: refused at once, not queued (Triton
    UNAVAILABLE; the project's clients retry it with backoff)."""
