"""One session's rounds as a timeline, for the console: each USER message, each model reply
with its tool calls and the results that answered them, the round in flight and the round
waiting for its children; folded to a bounded size. Runs in the caller's READ ONLY
transaction (``console.queries.read_only``); without ``show_content`` no text, only roles,
tool names and sizes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from sqlalchemy import func, select, text
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


def _fold(entries: list[dict[str, Any]], older: int = 0) -> list[dict[str, Any]]:
    """The timeline as shown: its last TIMELINE_ENTRIES entries (the first one kept says how
    many came before: ``earlier``, the ``older`` ones not read included), and in each the first
    CALLS_SHOWN tool calls (``calls_total`` and ``calls_answered`` count them all; the calls of
    a model reply or a waiting round beyond the first CALLS_SHOWN were only counted)."""
    for entry in entries:
        calls = entry.get("tool_calls") or []
        if "calls_total" in entry or len(calls) > CALLS_SHOWN:
            entry.setdefault("calls_total", len(calls))
            answered = sum(1 for c in calls[:CALLS_SHOWN] if c.get("result") or c.get("execution"))
            entry["calls_answered"] = entry.get("calls_answered", 0) + answered
            entry["tool_calls"] = calls[:CALLS_SHOWN]
    shown = entries[-TIMELINE_ENTRIES:]
    earlier = len(entries) - len(shown) + older
    if earlier and shown:
        shown[0] = {**shown[0], "earlier": earlier}
    return shown


#: The TOOL messages of the part of the history read (``id > :after``), each matched to the
#: newest earlier reply of that part naming its call (``:call_ids``, ``:reply_ids``,
#: ``:shown``: the replies' calls, parsed by the caller). Rows come back for a result of a shown
#: call (``kind`` 'result') and for the newest ``:orphans`` results no reply names ('orphan');
#: the rest are counted: the results of each reply's calls beyond its first CALLS_SHOWN
#: ('answered', per reply) and the older orphans ('older'). So a reply of 3,000 delegations
#: sends back its 50 shown results and one count, not 3,000 rows. The text of a result
#: (``:content``) and its size are read only for the rows sent, each by its primary key (a
#: LATERAL probe whose LIMIT keeps it from being flattened: a join there was planned as a scan of
#: the whole message table).
_TOOL_RESULTS = """
WITH calls AS (
    SELECT * FROM unnest(CAST(:call_ids AS text[]), CAST(:reply_ids AS bigint[]), CAST(:shown AS boolean[]))
        AS k(call_id, reply_id, shown)
), matched AS (
    SELECT DISTINCT ON (m.id) m.id, k.reply_id, k.shown
    FROM message m LEFT JOIN calls k ON k.call_id = m.tool_call_id AND k.reply_id < m.id
    WHERE m.session_id = :session_id AND m.role = 'TOOL' AND m.deleted IS false AND m.id > :after
    ORDER BY m.id, k.reply_id DESC
), orphans AS (
    SELECT id, row_number() OVER (ORDER BY id DESC) AS newest FROM matched WHERE reply_id IS NULL
), sent AS (
    SELECT id, reply_id, 'result' AS kind FROM matched WHERE shown
    UNION ALL
    SELECT id, NULL, 'orphan' FROM orphans WHERE newest <= :orphans
)
SELECT sent.kind, sent.reply_id, m.id, m.tool_call_id, m.created_at, m.source_session_id,
       coalesce(length(m.content), 0) AS size, CASE WHEN :content THEN m.content END AS content, 1 AS n
FROM sent CROSS JOIN LATERAL (SELECT * FROM message WHERE message.id = sent.id LIMIT 1) AS m
UNION ALL
SELECT 'answered', reply_id, NULL, NULL, NULL, NULL, NULL, NULL, count(*) FROM matched WHERE NOT shown GROUP BY reply_id
UNION ALL
SELECT 'older', NULL, NULL, NULL, NULL, NULL, NULL, NULL, count(*) FROM orphans WHERE newest > :orphans
ORDER BY 3
"""


@dataclass(frozen=True)
class _Calls:
    """A model reply's tool calls as the timeline uses them, parsed once: a message's calls
    never change once written (only ``deleted`` is ever updated)."""

    #: The first CALLS_SHOWN calls, as stored.
    shown: tuple[dict[str, Any], ...]
    #: Every call (0: none, or malformed: ``harness.history.parse_tool_calls``).
    total: int
    #: Every call's id, quoted for a PostgreSQL array literal, comma-separated (``_array``).
    ids: str


#: Replies parsed lately, by (message id, octet length of its calls, its time): a console
#: polled every second reads and parses a reply of 3,000 delegations (330 kB of JSON) once, not
#: every second. The size and the time tell a reused id apart (a database emptied with its
#: sequences restarted, as the tests do).
_PARSED: OrderedDict[tuple[int, int, datetime], _Calls] = OrderedDict()
#: Replies kept parsed (the least recently shown are forgotten first).
PARSED_KEPT = 256
_parsed_lock = threading.Lock()


def _parse(raw: str | None) -> _Calls:
    parsed = parse_tool_calls(raw)
    calls = parsed if isinstance(parsed, list) else []
    return _Calls(shown=tuple(calls[:CALLS_SHOWN]), total=len(calls), ids=_array([c.get("id") for c in calls])[1:-1])


def _replies_calls(s: Session, heads: list[Any]) -> dict[int, _Calls]:
    """The calls of the model replies among ``heads``: from ``_PARSED``, the others read (their
    ``tool_calls`` text, by primary key) and parsed once."""
    found: dict[int, _Calls] = {}
    missing: list[int] = []
    with _parsed_lock:
        for m in heads:
            if m.role == Role.ASSISTANT:
                key = (m.id, m.calls_size, m.created_at)
                hit = _PARSED.get(key)
                if hit is None:
                    missing.append(m.id)
                else:
                    _PARSED.move_to_end(key)
                    found[m.id] = hit
    if missing:
        m_ = Message.__table__.c
        read = s.execute(
            select(m_.id, m_.tool_calls, func.coalesce(func.octet_length(m_.tool_calls), 0), m_.created_at).where(
                m_.id.in_(missing)
            )
        ).all()
        with _parsed_lock:
            for mid, raw, size, at in read:
                found[mid] = _PARSED[(mid, int(size), at)] = _parse(raw)
            while len(_PARSED) > PARSED_KEPT:
                _PARSED.popitem(last=False)
    return found


def _array(values: list[Any]) -> str:
    """``values`` as one PostgreSQL array literal (``{"a","b"}``), sent as a single parameter:
    the driver would send a list as ``ARRAY['a', 'b', ...]``, an expression of one constant
    per element that PostgreSQL parses and plans several times slower (3,000 call ids)."""
    quoted = ('"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
    return "{" + ",".join(quoted) + "}"


def _result(m: Any, show_content: bool) -> dict[str, Any]:
    result = {
        "message_id": m.id,
        "size": int(m.size or 0),
        "at": _iso(m.created_at),
        "delivered_from_session_id": m.source_session_id,
    }
    if show_content:
        result["content"] = m.content
    return result


def timeline(s: Session, session_id: int, *, show_content: bool = False) -> list[dict[str, Any]]:
    """The session's history as rounds: each USER message, each model reply with its tool
    calls (their crash behaviour and the result that answered them: inline, or delivered from a
    child session), then the round in flight (journaled, not in the history yet) and the round
    waiting for its children; folded to a bounded size (``_fold``).

    What it reads is bounded whatever the history and the tree: the newest messages other than
    TOOL results that fit in TIMELINE_ENTRIES (the partial index ``ix_message_session_heads``),
    a count of the older ones, and of the TOOL results after the oldest of them only the rows
    shown (``_TOOL_RESULTS``: the rest are counted in the database); a reply's calls are parsed
    once (``_PARSED``). A TOOL result answers the
    newest earlier reply of that part naming its call; one that no reply there names is shown
    on its own (``tool_result``): an orphan (a history I2 forbids), or the answer to a reply
    older than the part read. ``earlier`` counts the older entries other than such orphans.
    Message text is read only when it is shown (its size comes from the database)."""
    extra = [*_journal_entries(s, session_id, show_content), *_waiting_round(s, session_id, show_content)]
    wanted = TIMELINE_ENTRIES - len(extra)  # message entries that fit beside them
    m_ = Message.__table__.c
    heads_where = (m_.session_id == session_id, m_.role != Role.TOOL, m_.deleted.is_(False))
    columns = [m_.id, m_.role, m_.created_at, func.coalesce(func.octet_length(m_.tool_calls), 0).label("calls_size")]
    columns.append(func.coalesce(func.length(m_.content), 0).label("size"))  # the size, not the text
    if show_content:
        columns.append(m_.content)
    heads = list(reversed(s.execute(select(*columns).where(*heads_where).order_by(m_.id.desc()).limit(wanted)).all()))
    older = 0
    after = 0
    if len(heads) == wanted:  # maybe more before: counted, not read
        after = heads[0].id - 1
        older = int(s.execute(select(func.count()).where(*heads_where, m_.id <= after)).scalar_one())
    entries: list[tuple[int, dict[str, Any]]] = []
    #: (reply id, call id) -> the call shown; reply id -> its entry (a reply with calls).
    shown_calls: dict[tuple[int, str], dict[str, Any]] = {}
    replies: dict[int, dict[str, Any]] = {}
    parsed = _replies_calls(s, heads)
    #: The array literals' parts: every call id of the replies, its reply, whether it is shown.
    call_ids: list[str] = []
    reply_ids: list[str] = []
    shown_flags: list[str] = []
    for m in heads:
        entry = _message_entry(m, show_content)
        if m.role == Role.ASSISTANT:
            reply = parsed[m.id]
            calls = [_call(c, show_content) for c in reply.shown]
            entry.update(kind="model_reply", tool_calls=calls)
            if reply.total > CALLS_SHOWN:
                entry.update(calls_total=reply.total, calls_answered=0)
            if reply.total:
                call_ids.append(reply.ids)
                reply_ids.append(",".join([str(m.id)] * reply.total))
                shown_flags.append(",".join(["t"] * len(reply.shown) + ["f"] * (reply.total - len(reply.shown))))
            for c in calls:
                shown_calls[(m.id, str(c["tool_call_id"]))] = c
            replies[m.id] = entry
        else:
            entry["kind"] = str(m.role).lower()
        entries.append((m.id, entry))
    params = {
        "call_ids": "{" + ",".join(call_ids) + "}",
        "reply_ids": "{" + ",".join(reply_ids) + "}",
        "shown": "{" + ",".join(shown_flags) + "}",
        "session_id": session_id,
        "after": after,
        "orphans": wanted,
        "content": show_content,
    }
    for r in s.execute(text(_TOOL_RESULTS), params).all():
        if r.kind == "result":
            call = shown_calls.get((r.reply_id, str(r.tool_call_id)))
            if call is not None:  # the newest result of a call answers it
                call["result"] = _result(r, show_content)
        elif r.kind == "orphan":
            orphan = _message_entry(SimpleNamespace(role=Role.TOOL, **r._mapping), show_content)
            orphan.update(kind="tool_result", tool_call_id=r.tool_call_id, **_result(r, show_content))
            entries.append((r.id, orphan))
        elif r.kind == "answered":
            replies[r.reply_id]["calls_answered"] += int(r.n)
        else:
            older += int(r.n)
    entries.sort(key=lambda pair: pair[0])
    out = [entry for _, entry in entries]
    if len(out) > wanted:  # orphans beside the heads: the newest kept
        older += len(out) - wanted
        out = out[-wanted:]
    return _fold([*out, *extra], older)


def _journal_entries(s: Session, session_id: int, show_content: bool) -> list[dict[str, Any]]:
    """The round in flight; its calls' journal rows are read for the calls shown only."""
    entry = s.execute(
        select(RoundJournal).where(RoundJournal.session_id == session_id, RoundJournal.closed_at.is_(None))
    ).scalar_one_or_none()
    if entry is None:
        return []
    listed = entry.tool_calls or []
    ids = [str(c.get("id")) for c in listed[:CALLS_SHOWN] if isinstance(c, dict)]
    J = RoundJournalCall
    rows = s.execute(select(J).where(J.journal_id == entry.id, J.tool_call_id.in_(ids))).scalars()
    journaled = {c.tool_call_id: c for c in rows}
    calls = []
    for call in listed[:CALLS_SHOWN]:
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
    if len(listed) > CALLS_SHOWN:  # a journaled call is not an answer: none of the rest is counted
        out.update(calls_total=len(listed), calls_answered=0)
    if show_content:
        out["content"] = entry.content
    return [out]


def _waiting_round(s: Session, session_id: int, show_content: bool) -> list[dict[str, Any]]:
    """The round waiting for its children: its first CALLS_SHOWN calls with their executions
    (read for those calls only, by the parent's unique (parent, call id) index) or inline
    results; the calls beyond are counted, those answered too (a child execution, or an inline
    result: a call is one or the other)."""
    rnd = s.execute(
        select(PendingRound).where(PendingRound.session_id == session_id, PendingRound.closed_at.is_(None))
    ).scalar_one_or_none()
    if rnd is None:
        return []
    listed = rnd.tool_calls or []
    inline = rnd.inline_results or {}
    ids = [str(c.get("id")) for c in listed[:CALLS_SHOWN] if isinstance(c, dict)]
    of_round = (E.parent_session_id == session_id, E.pending_round_id == rnd.id)
    children = {
        e.parent_tool_call_id: e
        for e in s.execute(
            select(E.id, E.status, E.delivery_status, E.parent_tool_call_id).where(
                *of_round, E.parent_tool_call_id.in_(ids)
            )
        ).all()
        if e.parent_tool_call_id
    }
    calls = []
    for call in listed[:CALLS_SHOWN]:
        item = _call(call, show_content)
        e = children.get(str(item["tool_call_id"]))
        if e is not None:
            item["execution"] = {"id": e.id, "status": str(e.status), "delivery_status": str(e.delivery_status)}
        elif item["tool_call_id"] in inline:
            item["result"] = {"inline": True, "size": _size(inline[item["tool_call_id"]])}
        calls.append(item)
    out: dict[str, Any] = {"kind": "waiting_for_children", "round_id": rnd.id, "at": _iso(rnd.created_at)}
    out["tool_calls"] = calls
    if len(listed) > CALLS_SHOWN:
        rest = [str(c.get("id")) for c in listed[CALLS_SHOWN:] if isinstance(c, dict)]
        delegated = s.execute(
            select(func.count()).where(*of_round, E.parent_tool_call_id.is_not(None), E.parent_tool_call_id.not_in(ids))
        ).scalar_one()
        out.update(calls_total=len(listed), calls_answered=int(delegated) + sum(1 for c in rest if c in inline))
    return [out]
