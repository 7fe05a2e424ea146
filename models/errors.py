"""Errors of the data layer: one root, leaves named as facts."""

from __future__ import annotations


class ModelError(Exception):
    """A data-layer rule was broken."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class IllegalTransition(ModelError):
    """The requested state transition is not allowed from the row's current state."""


class LeaseLost(ModelError):
    """This worker no longer owns the row (its epoch is stale); it must stop without writing."""
