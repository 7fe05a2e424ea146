"""Errors of the agent runtime: one root, leaves named as facts."""

from __future__ import annotations


class HarnessError(Exception):
    """The agent runtime could not do what was asked."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class BoundaryInvalid(HarnessError):
    """The compaction boundary is not a live message of this session."""


class ModelUnavailable(HarnessError):
    """The model endpoint could not be reached or answered with an error."""

    def __init__(self, message: str | None = None, *, code: str = "model_unavailable") -> None:
        super().__init__(message)
        self.code = code


class AgentConfigError(HarnessError):
    """The agent definitions are invalid."""


class UnknownAgent(HarnessError):
    """No agent definition has that name."""


class ToolError(HarnessError):
    """A tool failed; its message becomes the TOOL result."""


class Cancelled(HarnessError):
    """The session was cancelled."""


class DeadlineExceeded(HarnessError):
    """The absolute deadline of this execution has passed."""
