"""Writing one complete tool round: one ASSISTANT with tool_calls + every TOOL, in tool-call
order, in the caller's transaction (docs/invariants.md, I2; delivery's use of it:
docs/exactly-once.md). The named crash points inside let tests prove the whole round rolls back
(docs/fault-model.md, R25)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.history import insert_messages
from models import Role


@dataclass(frozen=True)
class ToolResult:
    tool_call_id: str
    content: str
    source_session_id: int | None = None


def write_round(
    s: Session,
    session_id: int,
    assistant_content: str | None,
    tool_calls: list[dict[str, Any]],
    results: Sequence[ToolResult],
    provider_fields: dict[str, Any] | None = None,
) -> tuple[int, dict[str, int]]:
    """Insert the assistant and its TOOL rows; returns (assistant id, {tool_call_id: TOOL id}).

    ``results`` must answer every tool call exactly once (I2); anything else is a bug.
    ``provider_fields``: the reply's own fields, kept on the assistant (docs/providers.md).
    """
    # ONE statement for the whole round: the assistant first, then every TOOL in the order
    # given (delivery orders by execution id); the crash points stay inside the transaction.
    rows = _round_rows(assistant_content, tool_calls, results, provider_fields)
    assistant_id, *tool_row_ids = insert_messages(s, session_id, rows)
    crash_point("round.after_assistant")
    tool_ids = {r.tool_call_id: i for r, i in zip(results, tool_row_ids, strict=True)}
    if results:
        crash_point("round.after_some_tools")
    crash_point("round.after_all_tools")
    return assistant_id, tool_ids


def _round_rows(
    assistant_content: str | None,
    tool_calls: list[dict[str, Any]],
    results: Sequence[ToolResult],
    provider_fields: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The message rows of one round: the assistant, then every TOOL in the order given.
    ``results`` must answer every tool call exactly once (I2); anything else is a bug."""
    ids = [str(c["id"]) for c in tool_calls]
    by_id = {r.tool_call_id: r for r in results}
    if sorted(by_id) != sorted(ids) or len(results) != len(ids):
        raise ValueError("a round must answer every tool call exactly once")
    rows: list[dict[str, Any]] = [
        {
            "role": Role.ASSISTANT,
            "content": assistant_content or "",
            "tool_calls": tool_calls,
            "provider_fields": provider_fields,
        }
    ]
    rows += [
        {
            "role": Role.TOOL,
            "content": r.content,
            "tool_call_id": r.tool_call_id,
            "source_session_id": r.source_session_id,
        }
        for r in results
    ]
    return rows


@dataclass(frozen=True)
class RoundWrite:
    """One session's complete round, for :func:`write_rounds`."""

    session_id: int
    assistant_content: str | None
    tool_calls: list[dict[str, Any]]
    results: Sequence[ToolResult]
    provider_fields: dict[str, Any] | None = None


def write_rounds(s: Session, rounds: Sequence[RoundWrite]) -> list[tuple[int, dict[str, int]]]:
    """``write_round`` for several sessions' rounds in ONE statement, in the caller's
    transaction; (assistant id, {tool_call_id: TOOL id}) per round, in the order given. Each
    round is checked as ``write_round`` checks it (I2) before anything is written."""
    rows: list[dict[str, Any]] = []
    for rnd in rounds:
        rows += [
            {**row, "session_id": rnd.session_id}
            for row in _round_rows(rnd.assistant_content, rnd.tool_calls, rnd.results, rnd.provider_fields)
        ]
    ids = iter(insert_messages(s, rounds[0].session_id, rows) if rows else [])
    written = []
    for rnd in rounds:
        assistant_id = next(ids)
        written.append((assistant_id, {r.tool_call_id: next(ids) for r in rnd.results}))
    return written
