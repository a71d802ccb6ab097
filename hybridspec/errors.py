"""Errors for bad input to a call that name the parameter at fault, so that callers (the server's 400s) never read
it from the message. Cheap to import: nothing but the standard library."""
from __future__ import annotations

__all__ = ["InvalidParameter", "InvalidParameterType", "ContextLengthExceeded", "QueueFull"]


class InvalidParameter(ValueError):
    """A call's argument is invalid. `param` names it as the Python API does: "max_new_tokens", "temperature",
    "speculate", "stop", "seed", "prompt", "messages", "messages[2].content", ... A ValueError: `except ValueError`
    catches it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickles with its param (across processes)
        return type(self), (self.args[0], self.param)


class InvalidParameterType(InvalidParameter, TypeError):
    """An argument of the wrong kind (a prompt that is no prompt, an object that is no proposer): also a TypeError."""


class ContextLengthExceeded(InvalidParameter):
    """The prompt leaves no room in the model's context (`param` "prompt")."""


class QueueFull(RuntimeError):
    """The engine is at its limits and as many calls as it queues are already waiting: the call was refused before it
    held anything (the server's 429). `retry_after`: seconds after which a place is likely free."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self):
        return type(self), (self.args[0], self.retry_after)
