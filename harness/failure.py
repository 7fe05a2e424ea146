"""Why a run failed: the one place where what ended a run becomes the ``FailureReason`` its
session stores (docs/providers.md, "Failure reasons")."""

from __future__ import annotations

from harness.errors import (
    BudgetExhausted,
    DeadlineExceeded,
    MaxRoundsReached,
    ModelUnavailable,
    ToolArgumentsRejected,
    ToolError,
)
from harness.results import safe_reason
from models.enums import FailureCode
from models.session import FailureReason

#: ``ModelReply.incomplete`` -> the code of an answer the model did not finish.
INCOMPLETE_CODES = {
    "length": FailureCode.TRUNCATED,
    "content_filter": FailureCode.CONTENT_FILTER,
    "refusal": FailureCode.REFUSAL,
    "no_tool_calls": FailureCode.NO_TOOL_CALLS,
}
#: Why an answer the model did not finish is not a result, by ``ModelReply.incomplete``.
INCOMPLETE_REASONS = {
    "length": "the model's answer was cut off at its token limit (finish_reason length)",
    "content_filter": "the provider's content filter withheld the model's answer (finish_reason content_filter)",
    "refusal": "the model refused the task",
    "no_tool_calls": "the model said it called tools but its reply held no call (finish_reason tool_calls)",
}


def incomplete_reason(incomplete: str) -> FailureReason:
    """The reason of a run that ends on an answer the model did not finish."""
    return FailureReason(INCOMPLETE_CODES[incomplete], INCOMPLETE_REASONS[incomplete])


def reason_for(exc: BaseException) -> FailureReason:
    """The reason of a run that ``exc`` ended. A model error's message names the endpoint and
    the provider's own error (with the key and any echo of the request redacted by the client);
    anything unexpected is named by its type alone: its text may hold content."""
    if isinstance(exc, ModelUnavailable):
        try:
            code = FailureCode(exc.reason)
        except ValueError:
            code = FailureCode.MODEL_UNAVAILABLE
        return FailureReason(code, safe_reason(str(exc)))
    if isinstance(exc, MaxRoundsReached):
        return FailureReason(FailureCode.MAX_ROUNDS, str(exc))
    if isinstance(exc, DeadlineExceeded):
        return FailureReason(FailureCode.DEADLINE, str(exc))
    if isinstance(exc, BudgetExhausted):
        return FailureReason(FailureCode.BUDGET_EXHAUSTED, str(exc))
    if isinstance(exc, ToolArgumentsRejected):
        return FailureReason(FailureCode.TOOL_ARGUMENTS, str(exc))
    if isinstance(exc, ToolError):
        return FailureReason(FailureCode.TOOL_CRASH, f"a tool failed outside its call: {type(exc).__name__}")
    return FailureReason(FailureCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
