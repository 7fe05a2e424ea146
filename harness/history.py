"""Message history rules that everything else relies on (docs/invariants.md, I2).

Two views of a session's history:
- RAW rows (``deleted = false``, after a validated compaction boundary): what recovery and
  delivery reason about. ``cleanup_incomplete_tail`` and ``pair_state`` work here.
- The NORMALIZED view (``normalize``): what a model may be shown. It never contains an orphan
  TOOL, an assistant tool_call without its TOOL, or a row with malformed tool_calls JSON.

A tool round is an ASSISTANT row with tool_calls immediately followed by its TOOL rows (the
OpenAI protocol requires the results right after the call); a round is complete when every
tool_call id has a TOOL row in that run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from sqlalchemy import Table, bindparam, insert, select, update
from sqlalchemy.orm import Session

from harness.errors import BoundaryInvalid
from models import AgentSession, Message, Role
from models.base import utcnow
from models.db import built_once


class Row(Protocol):
    """A message row: a Message, or any object with these read-only fields (tests)."""

    @property
    def id(self) -> int: ...
    @property
    def role(self) -> Role | str: ...
    @property
    def content(self) -> str | None: ...
    @property
    def tool_calls(self) -> str | None: ...
    @property
    def tool_call_id(self) -> str | None: ...


MALFORMED = object()


def parse_tool_calls(raw: str | None) -> list[dict[str, Any]] | object | None:
    """The stored tool_calls text as a list, None when absent/empty, MALFORMED when unusable.

    Usable means: a JSON list whose items each have a string ``id`` and ``function.name``.
    """
    if raw is None or raw.strip() in ("", "null", "[]"):
        return None
    try:
        calls = json.loads(raw)
    except (ValueError, TypeError):
        return MALFORMED
    if not isinstance(calls, list) or not calls:
        return MALFORMED
    ids = set()
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not call["id"]:
            return MALFORMED
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return MALFORMED
        if call["id"] in ids:
            return MALFORMED
        ids.add(call["id"])
    return calls


def _role(row: Row) -> str:
    return str(row.role)


def _call_ids(calls: list[dict[str, Any]]) -> list[str]:
    return [str(c["id"]) for c in calls]


def normalize(rows: Sequence[Row]) -> list[Row]:
    """What a model may be shown: complete tool rounds, no orphans, no malformed rows.

    ``rows`` are live rows in history order. Deterministic and pure.
    """
    out: list[Row] = []
    i, n = 0, len(rows)
    while i < n:
        row = rows[i]
        role = _role(row)
        if role == Role.TOOL:
            i += 1  # orphan: not inside a round's TOOL run
            continue
        if role != Role.ASSISTANT:
            out.append(row)
            i += 1
            continue
        calls = parse_tool_calls(row.tool_calls)
        if calls is MALFORMED:
            i += 1
            j = i
            while j < n and _role(rows[j]) == Role.TOOL:
                j += 1
            i = j
            continue
        if calls is None:
            out.append(row)
            i += 1
            continue
        assert isinstance(calls, list)
        wanted = _call_ids(calls)
        j = i + 1
        results: dict[str, Row] = {}
        while j < n and _role(rows[j]) == Role.TOOL:
            tid = rows[j].tool_call_id
            if tid in wanted and tid not in results:
                results[tid] = rows[j]
            j += 1
        if len(results) == len(wanted):
            out.append(row)
            out.extend(sorted(results.values(), key=lambda r: r.id))  # history order
        i = j
    return out


def check_legal(rows: Sequence[Row]) -> list[str]:
    """Violations of I2 (docs/invariants.md) in ``rows`` (live, in order); empty when the history is legal."""
    problems: list[str] = []
    i, n = 0, len(rows)
    while i < n:
        row = rows[i]
        role = _role(row)
        if role == Role.TOOL:
            problems.append(f"orphan TOOL {row.id} ({row.tool_call_id})")
            i += 1
            continue
        if role == Role.ASSISTANT:
            calls = parse_tool_calls(row.tool_calls)
            if calls is MALFORMED:
                problems.append(f"malformed tool_calls in {row.id}")
            elif calls:
                assert isinstance(calls, list)
                wanted = _call_ids(calls)
                j = i + 1
                seen: list[str] = []
                while j < n and _role(rows[j]) == Role.TOOL:
                    tid = rows[j].tool_call_id
                    if tid not in wanted or tid in seen:
                        problems.append(f"orphan TOOL {rows[j].id} ({tid})")
                    else:
                        seen.append(str(tid))
                    j += 1
                missing = [w for w in wanted if w not in seen]
                if missing:
                    problems.append(f"assistant {row.id} lacks TOOL for {missing}")
                i = j
                continue
        i += 1
    return problems


# --- raw rows in the database -------------------------------------------------------------


def validated_boundary(s: Session, session_id: int) -> int | None:
    """The session's compaction boundary, checked to be a live message of that session."""
    boundary = s.execute(
        select(AgentSession.compaction_boundary_message_id).where(AgentSession.id == session_id)
    ).scalar_one_or_none()
    if boundary is None:
        return None
    check_boundary(s, session_id, boundary)
    return boundary


def check_boundary(s: Session, session_id: int, boundary: int | None) -> None:
    if boundary is None:
        return
    live = s.execute(_boundary_stmt(), {"b_id": boundary, "b_sid": session_id}).scalar_one_or_none()
    if live is None:
        raise BoundaryInvalid(f"compaction boundary {boundary} is not a live message of session {session_id}")


@built_once
def _boundary_stmt() -> Any:
    return select(Message.id).where(
        Message.id == bindparam("b_id"), Message.session_id == bindparam("b_sid"), Message.deleted.is_(False)
    )


def load_raw(s: Session, session_id: int, boundary: int | None = None, *, validate: bool = True) -> list[Message]:
    """Live rows of a session after ``boundary`` (validated), in history order."""
    if validate:
        check_boundary(s, session_id, boundary)
    return list(s.execute(_raw_stmt(), {"b_sid": session_id, "b_after": boundary or 0}).scalars())


@built_once
def _raw_stmt() -> Any:
    return (
        select(Message)
        .where(Message.session_id == bindparam("b_sid"), Message.deleted.is_(False), Message.id > bindparam("b_after"))
        .order_by(Message.id)
    )


def tail_garbage(rows: Sequence[Row]) -> list[int]:
    """Ids that ``cleanup_incomplete_tail`` removes from ``rows`` (pure).

    Find the last tool round. If any of its results is missing (or its JSON is malformed), it
    goes with every TOOL after it. Otherwise only orphan TOOLs after it go (duplicates, ids it
    did not call, TOOLs after a later plain message).
    """
    last = next(
        (
            i
            for i in range(len(rows) - 1, -1, -1)
            if _role(rows[i]) == Role.ASSISTANT and parse_tool_calls(rows[i].tool_calls) is not None
        ),
        None,
    )
    if last is None:
        return [r.id for r in rows if _role(r) == Role.TOOL]
    calls = parse_tool_calls(rows[last].tool_calls)
    wanted = _call_ids(calls) if isinstance(calls, list) else []
    run = _tool_run(rows, last)
    answered: list[str] = []
    extra: list[int] = []
    for r in run:
        if r.tool_call_id in wanted and r.tool_call_id not in answered:
            answered.append(str(r.tool_call_id))
        else:
            extra.append(r.id)
    after_run = [r.id for r in rows[last + 1 + len(run) :] if _role(r) == Role.TOOL]
    if not isinstance(calls, list) or len(answered) != len(wanted):
        return [rows[last].id] + [r.id for r in run] + after_run
    return extra + after_run


def cleanup_incomplete_tail(
    s: Session,
    session_id: int,
    boundary: int | None,
    *,
    protected: frozenset[int] | Callable[[], frozenset[int]] = frozenset(),
    rows: Sequence[Row] | None = None,
) -> list[int]:
    """Logically delete the last tool round lacking any TOOL result, and orphan TOOLs after it.

    Works on RAW live rows after the validated boundary; complete rounds are kept. Returns the
    ids it deleted (empty when the tail was already clean). Interrupted tools are never re-run:
    the model is asked again from the last complete round. ``protected`` rows (another
    execution's delivered result) are never deleted; given as a function, it is asked only
    when the tail has something to delete (a clean tail costs no read of them). ``rows``: the
    live rows after the boundary when the caller has read (and validated) them already.
    """
    rows = rows if rows is not None else load_raw(s, session_id, boundary)
    garbage = tail_garbage(rows)
    if not garbage:
        return []
    keep = protected() if callable(protected) else protected
    ids = [i for i in garbage if i not in keep]
    if ids:
        s.execute(
            update(Message)
            .where(Message.id.in_(ids), Message.session_id == session_id)
            .values(deleted=True)
            .execution_options(synchronize_session=False)
        )
    return ids


@dataclass(frozen=True)
class PairState:
    """What the raw history holds for one tool_call id."""

    assistant_id: int | None  #: the assistant of a complete pair
    tool_id: int | None  #: its TOOL
    broken_ids: tuple[int, ...]  #: rows referring to the id that are not part of a complete pair

    @property
    def complete(self) -> bool:
        return self.assistant_id is not None and self.tool_id is not None


def pair_state(s: Session, session_id: int, tool_call_id: str, *, protected: frozenset[int] = frozenset()) -> PairState:
    """Inspect raw live rows for ``tool_call_id``: a complete assistant+TOOL pair, or the
    broken rows (malformed JSON naming the id, orphan TOOL, assistant without its TOOL).

    The repair never reaches rows it must keep: nothing at or before the compaction boundary
    (the summary stands for them), and no round that holds a ``protected`` row (another
    execution's delivered assistant or TOOL) — only this id's own TOOL rows leave such a
    round, so another execution's delivered result is never deleted."""
    rows = load_raw(s, session_id, None, validate=False)
    boundary = validated_boundary(s, session_id)
    keep = set(protected)
    if boundary is not None:
        keep |= {r.id for r in rows if r.id <= boundary}
    assistant_id = tool_id = None
    broken: list[int] = []
    for idx, row in enumerate(rows):
        if _role(row) != Role.ASSISTANT or row.tool_calls is None or tool_call_id not in row.tool_calls:
            continue
        calls = parse_tool_calls(row.tool_calls)
        run = _tool_run(rows, idx)
        guarded = row.id in keep or any(r.id in keep for r in run)
        if calls is MALFORMED:
            if guarded:
                broken.extend(r.id for r in run if r.tool_call_id == tool_call_id and r.id not in keep)
            else:
                broken.append(row.id)
                broken.extend(r.id for r in run)
            continue
        if not isinstance(calls, list) or tool_call_id not in _call_ids(calls):
            continue
        answers = [r for r in run if r.tool_call_id == tool_call_id]
        wanted = _call_ids(calls)
        round_complete = all(any(r.tool_call_id == w for r in run) for w in wanted)
        if answers and round_complete and assistant_id is None:
            assistant_id, tool_id = row.id, answers[0].id
            broken.extend(r.id for r in answers[1:] if r.id not in keep)
        elif guarded:
            broken.extend(r.id for r in answers if r.id not in keep)
        else:
            broken.append(row.id)
            broken.extend(r.id for r in run)
    paired = {tool_id} | set(broken)
    for row in rows:
        if _role(row) == Role.TOOL and row.tool_call_id == tool_call_id and row.id not in paired | keep:
            broken.append(row.id)  # orphan TOOL
    return PairState(assistant_id, tool_id, tuple(sorted(set(broken) - keep)))


def _tool_run(rows: Sequence[Any], idx: int) -> list[Any]:
    run = []
    j = idx + 1
    while j < len(rows) and _role(rows[j]) == Role.TOOL:
        run.append(rows[j])
        j += 1
    return run


def delete_rows(s: Session, session_id: int, ids: Sequence[int]) -> None:
    if ids:
        s.execute(
            update(Message)
            .where(Message.id.in_(list(ids)), Message.session_id == session_id)
            .values(deleted=True)
            .execution_options(synchronize_session=False)
        )


def insert_messages(s: Session, session_id: int, rows: Sequence[dict[str, Any]]) -> list[int]:
    """Insert ``rows`` (``role``, ``content`` and optionally ``tool_calls``, ``tool_call_id``,
    ``source_session_id``, and ``session_id`` when a row goes to another session than
    ``session_id``) in ONE statement in the caller's transaction; returns their ids in the
    order given, which is their history order (``sort_by_parameter_order``: on PostgreSQL the
    rows are inserted, and their ids drawn, in parameter order)."""
    return [int(i) for i in s.execute(_insert_stmt(), _rows(session_id, rows)).scalars()]


def _rows(session_id: int, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    now = utcnow()
    return [
        {
            "session_id": r.get("session_id", session_id),
            "role": r["role"],
            "content": r.get("content"),
            "tool_calls": json.dumps(r["tool_calls"]) if r.get("tool_calls") else None,
            "tool_call_id": r.get("tool_call_id"),
            "source_session_id": r.get("source_session_id"),
            "provider_fields": r.get("provider_fields") or None,
            "incomplete": r.get("incomplete"),
            "deleted": False,
            "created_at": now,
        }
        for r in rows
    ]


def message_row(
    session_id: int,
    role: Role,
    content: str | None,
    *,
    provider_fields: dict[str, Any] | None = None,
    incomplete: str | None = None,
) -> dict[str, Any]:
    """One message row as ``insert_messages`` writes it (every column), for a statement that
    inserts it beside other rows (models.reply)."""
    row = {"role": role, "content": content, "provider_fields": provider_fields, "incomplete": incomplete}
    return _rows(session_id, [row])[0]


@built_once
def _insert_stmt() -> Any:
    table = cast(Table, Message.__table__)
    return insert(table).returning(table.c.id, sort_by_parameter_order=True)


def append_message(
    s: Session,
    session_id: int,
    role: Role,
    content: str | None,
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    tool_call_id: str | None = None,
    source_session_id: int | None = None,
    provider_fields: dict[str, Any] | None = None,
    incomplete: str | None = None,
) -> int:
    """Insert one row in the caller's transaction (a Core INSERT ... RETURNING); its id."""
    row = {
        "role": role,
        "content": content,
        "tool_calls": tool_calls,
        "tool_call_id": tool_call_id,
        "source_session_id": source_session_id,
        "provider_fields": provider_fields,
        "incomplete": incomplete,
    }
    return insert_messages(s, session_id, [row])[0]


#: Key of the provider's own id in a stored call whose ``id`` is our local one (harness.callids).
PROVIDER_ID = "provider_id"


def to_openai(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Normalized rows as OpenAI chat messages, with the provider's own tool_call ids: a
    stored call under a local id carries the provider's beside it (any length), and each TOOL
    answers its round's call under that id."""
    out: list[dict[str, Any]] = []
    provider_ids: dict[str, str] = {}  # local id -> provider id, of the last tool round
    for row in rows:
        role = _role(row).lower()
        msg: dict[str, Any] = {"role": role, "content": row.content or ""}
        if role == "assistant":
            calls = parse_tool_calls(row.tool_calls)
            if isinstance(calls, list):
                provider_ids = {str(c["id"]): str(c[PROVIDER_ID]) for c in calls if PROVIDER_ID in c}
                msg["tool_calls"] = [_provider_call(c) for c in calls] if provider_ids else calls
            # The provider's own fields go back as they came (a ``content`` list replaces the text).
            msg.update(getattr(row, "provider_fields", None) or {})
        if role == "tool":
            msg["tool_call_id"] = provider_ids.get(str(row.tool_call_id), row.tool_call_id)
        out.append(msg)
    return out


def _provider_call(call: dict[str, Any]) -> dict[str, Any]:
    if PROVIDER_ID not in call:
        return call
    out = {k: v for k, v in call.items() if k != PROVIDER_ID}
    out["id"] = call[PROVIDER_ID]
    return out


#: The columns a model view reads (a Core select: no ORM objects on the hot path).
_VIEW_COLUMNS = (
    Message.id,
    Message.role,
    Message.content,
    Message.tool_calls,
    Message.tool_call_id,
    Message.provider_fields,
)


@dataclass(frozen=True)
class Compaction:
    """A session's compaction state: messages with id <= ``boundary`` are summarized."""

    boundary: int | None = None
    summary: str | None = None


def compaction_of(s: Session, session_id: int) -> Compaction:
    found = s.execute(_compaction_stmt(), {"b_sid": session_id}).one_or_none()
    return Compaction(*found) if found is not None else Compaction()


@built_once
def _compaction_stmt() -> Any:
    S = AgentSession
    return select(S.compaction_boundary_message_id, S.compaction_summary).where(S.id == bindparam("b_sid"))


@built_once
def _view_stmt() -> Any:
    return (
        select(*_VIEW_COLUMNS)
        .where(Message.session_id == bindparam("b_sid"), Message.deleted.is_(False), Message.id > bindparam("b_after"))
        .order_by(Message.id)
    )


def model_view(
    s: Session, session_id: int, compaction: Compaction | None = None, rows: Sequence[Row] | None = None
) -> list[dict[str, Any]]:
    """The OpenAI messages of a session: compaction summary first, then the normalized rows
    after its (validated) compaction boundary. ``compaction`` when the caller's transaction
    has read it already (one statement fewer); ``rows`` with it when that transaction has read
    (and validated) the live rows after the boundary too (one more)."""
    compaction = compaction if compaction is not None else compaction_of(s, session_id)
    boundary, summary = compaction.boundary, compaction.summary
    if rows is None:
        check_boundary(s, session_id, boundary)
        rows = s.execute(_view_stmt(), {"b_sid": session_id, "b_after": boundary or 0}).all()
    messages = to_openai(normalize(list(rows)))
    if boundary is not None and summary:
        messages.insert(0, {"role": "system", "content": f"Summary of the earlier conversation: {summary}"})
    return messages
