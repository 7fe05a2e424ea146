"""The ONE result factory: the same JSON for the normal path and recovery."""

from __future__ import annotations

from typing import Any

#: Longest failure reason kept in a result or error column (I8: no full answers in errors).
MAX_REASON_CHARS = 300


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def followup_fields(round_no: int, completed_rounds: int) -> dict[str, Any]:
    return {"follow_up": True, "round": round_no, "completed_rounds": completed_rounds}


def success_result(
    *,
    agent_type: str,
    child_session_id: int,
    text: str,
    rounds: int,
    tool_calls: int,
    prompt_tokens: int,
    completion_tokens: int,
    followup: dict[str, Any] | None = None,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "success": True,
        "cancelled": False,
        "agent_type": agent_type,
        "child_session_id": child_session_id,
        "result": text,
        "rounds": rounds,
        "tool_calls": tool_calls,
        "usage": _usage(prompt_tokens, completion_tokens),
    }
    if followup:
        result.update(followup)
    return result


def failure_result(
    *,
    agent_type: str,
    child_session_id: int,
    reason: str,
    cancelled: bool = False,
    followup: dict[str, Any] | None = None,
    partial: str | None = None,
) -> dict[str, Any]:
    """``partial``: the text of an answer the model did not finish, kept as ``partial_result``."""
    reason = safe_reason(reason)
    result: dict[str, Any] = {
        "success": False,
        "cancelled": cancelled,
        "agent_type": agent_type,
        "child_session_id": child_session_id,
        "result": reason,
        "error": reason,
    }
    if partial is not None:
        result["partial_result"] = partial
    if followup:
        result.update(followup)
    return result


def safe_reason(reason: str) -> str:
    reason = " ".join(reason.split())
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 1] + "…"


def describe_exception(exc: BaseException) -> str:
    """A safe one-line reason: the exception type and a capped message (no payloads)."""
    text = str(exc).strip()
    return safe_reason(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
