"""One session's rounds as a timeline, for the console: each USER message, each model reply
with its tool calls and the results that answered them, the round in flight and the round
waiting for its children; folded to a bounded size. Runs in the caller's READ ONLY
transaction (``console.queries.read_only``); without ``show_content`` no text, only roles,
tool names and sizes."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from harness.history import parse_tool_calls
from models import Message, Role, SubagentExecution
from models.journal import RoundJournal, RoundJournalCall
from models.round import PendingRound

E = SubagentExecution

#: The timeline shows a session's last this many entries (rounds' messages, the round in
#: flight, the round waiting for its children) ...
TIMELINE_ENTRIES = 100
#: ... and in each, the first this many tool calls (the rest counted).
CALLS_SHOWN = 50
#: Tools that hand work to a child session: their result is delivered from the child.
DELEGATING_TOOLS = ("delegate", "delegate_followup")


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _crash_behaviour(name: str) -> str:
    """What happens to this tool call after a crash (the tool's declaration)."""
    from harness.tools.registry import REGISTRY

    if name in DELEGATING_TOOLS:
        return "delegated"  # a child session; its result is delivered exactly once
    tool = REGISTRY.get(name)
    if tool is None:
        return "unknown"  # not registered in this process (an MCP tool, another deployment's tool)
    if tool.read_only:
        return "read_only"
    if tool.idempotent:
        return "idempotent"
    return "at_most_once"


def _size(text_value: str | None) -> int:
    return len(text_value or "")


def _call(call: dict[str, Any], show_content: bool) -> dict[str, Any]:
    fn = call.get("function") or {}
    name = str(fn.get("name", ""))
    out: dict[str, Any] = {
        "tool_call_id": call.get("id"),
        "name": name,
        "crash": _crash_behaviour(name),
        "arguments_size": _size(fn.get("arguments") if isinstance(fn.get("arguments"), str) else None),
        "result": None,
    }
    if show_content:
        out["arguments"] = fn.get("arguments")
    return out


def _message_entry(m: Any, show_content: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "message_id": m.id,
        "role": str(m.role),
        "at": _iso(m.created_at),
        "size": int(m.size or 0),
    }
    if show_content:
        entry["content"] = m.content
    return entry


def _fold(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timeline as shown: its last TIMELINE_ENTRIES entries (the first one kept says how
    many came before: ``earlier``), and in each the first CALLS_SHOWN tool calls
    (``calls_total`` and ``calls_answered`` count them all; a model reply's calls beyond the
    first CALLS_SHOWN were only counted by ``timeline``)."""
    for entry in entries:
        calls = entry.get("tool_calls") or []
        if "calls_total" in entry or len(calls) > CALLS_SHOWN:
            entry.setdefault("calls_total", len(calls))
            answered = sum(1 for c in calls[:CALLS_SHOWN] if c.get("result") or c.get("execution"))
            entry["calls_answered"] = entry.get("calls_answered", 0) + answered
            entry["tool_calls"] = calls[:CALLS_SHOWN]
    if len(entries) <= TIMELINE_ENTRIES:
        return entries
    shown = entries[-TIMELINE_ENTRIES:]
    shown[0] = {**shown[0], "earlier": len(entries) - TIMELINE_ENTRIES}
    return shown


def timeline(s: Session, session_id: int, *, show_content: bool = False) -> list[dict[str, Any]]:
    """The session's history as rounds: each USER message, each model reply with its tool
    calls (their crash behaviour and the result that answered them: inline, or delivered from a
    child session), then the round in flight (journaled, not in the history yet) and the round
    waiting for its children; folded to a bounded size (``_fold``). Message text is read only
    when it is shown (its size comes from the database)."""
    out: list[dict[str, Any]] = []
    calls_by_id: dict[str, dict[str, Any]] = {}
    #: Calls beyond a reply's first CALLS_SHOWN: only counted (their reply entry, by call id).
    folded: dict[str, dict[str, Any]] = {}
    m_ = Message.__table__.c
    columns = [m_.id, m_.role, m_.created_at, m_.tool_calls, m_.tool_call_id, m_.source_session_id]
    columns.append(func.coalesce(func.length(m_.content), 0).label("size"))  # the size, not the text
    if show_content:
        columns.append(m_.content)
    messages = s.execute(
        select(*columns).where(m_.session_id == session_id, m_.deleted.is_(False)).order_by(m_.id)
    ).all()
    for m in messages:
        if m.role == Role.TOOL and str(m.tool_call_id) in folded:  # counted, not shown
            folded[str(m.tool_call_id)]["calls_answered"] += 1
            continue
        entry = _message_entry(m, show_content)
        if m.role == Role.ASSISTANT:
            parsed = parse_tool_calls(m.tool_calls)
            parsed = parsed if isinstance(parsed, list) else []
            calls = [_call(c, show_content) for c in parsed[:CALLS_SHOWN]]
            entry.update(kind="model_reply", tool_calls=calls)
            for c in calls:
                if c["tool_call_id"]:
                    calls_by_id[str(c["tool_call_id"])] = c
            if len(parsed) > CALLS_SHOWN:
                entry.update(calls_total=len(parsed), calls_answered=0)
                folded.update((str(c.get("id")), entry) for c in parsed[CALLS_SHOWN:] if isinstance(c, dict))
        elif m.role == Role.TOOL:
            result = {
                "message_id": m.id,
                "size": int(m.size or 0),
                "at": _iso(m.created_at),
                "delivered_from_session_id": m.source_session_id,
            }
            if show_content:
                result["content"] = m.content
            call = calls_by_id.get(str(m.tool_call_id))
            if call is not None:
                call["result"] = result
                continue
            entry.update(kind="tool_result", tool_call_id=m.tool_call_id, **result)
        else:
            entry["kind"] = str(m.role).lower()
        out.append(entry)
    out.extend(_journal_entries(s, session_id, show_content))
    out.extend(_waiting_round(s, session_id, show_content))
    return _fold(out)


def _journal_entries(s: Session, session_id: int, show_content: bool) -> list[dict[str, Any]]:
    entry = s.execute(
        select(RoundJournal).where(RoundJournal.session_id == session_id, RoundJournal.closed_at.is_(None))
    ).scalar_one_or_none()
    if entry is None:
        return []
    journaled = {
        c.tool_call_id: c
        for c in s.execute(select(RoundJournalCall).where(RoundJournalCall.journal_id == entry.id)).scalars()
    }
    calls = []
    for call in entry.tool_calls or []:
        item = _call(call, show_content)
        j = journaled.get(str(item["tool_call_id"]))
        item["journal"] = None
        if j is not None:
            item["journal"] = {"status": str(j.status), "starts": j.starts, "repeatable": j.repeatable}
        calls.append(item)
    out: dict[str, Any] = {
        "kind": "round_in_flight",
        "journal_id": entry.id,
        "epoch": entry.epoch,
        "at": _iso(entry.created_at),
        "replays": entry.replays,
        "size": _size(entry.content),
        "tool_calls": calls,
    }
    if show_content:
        out["content"] = entry.content
    return [out]


def _waiting_round(s: Session, session_id: int, show_content: bool) -> list[dict[str, Any]]:
    rnd = s.execute(
        select(PendingRound).where(PendingRound.session_id == session_id, PendingRound.closed_at.is_(None))
    ).scalar_one_or_none()
    if rnd is None:
        return []
    children = {
        e.parent_tool_call_id: e
        for e in s.execute(select(E).where(E.pending_round_id == rnd.id)).scalars()
        if e.parent_tool_call_id
    }
    calls = []
    for call in rnd.tool_calls or []:
        item = _call(call, show_content)
        e = children.get(str(item["tool_call_id"]))
        if e is not None:
            item["execution"] = {"id": e.id, "status": str(e.status), "delivery_status": str(e.delivery_status)}
        elif item["tool_call_id"] in (rnd.inline_results or {}):
            item["result"] = {"inline": True, "size": _size(rnd.inline_results[item["tool_call_id"]])}
        calls.append(item)
    return [{"kind": "waiting_for_children", "round_id": rnd.id, "at": _iso(rnd.created_at), "tool_calls": calls}]
