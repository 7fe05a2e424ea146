"""Errors of crash recovery: one root, leaves named as facts."""

from __future__ import annotations


class RecoveryError(Exception):
    """Crash recovery could not do what was asked."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ExecutionNotFound(RecoveryError):
    """No execution has that id."""
