"""The timeline reads a bounded part of a session's history (docs/console.md, "Size"): the
newest entries that fit, a count of the older ones, and of the TOOL results after them only
those it shows; what it shows is what reading the whole history gave, on the real PostgreSQL
schema (``alembic upgrade head``: the partial index of migration 0033)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, select, text

from console.queries import read_only
from console.timeline import CALLS_SHOWN, TIMELINE_ENTRIES, timeline
from models import Message, Role, transaction
from tests.helpers import add_message, make_session

pytestmark = pytest.mark.usefixtures("db")


def _whole_history(session_id: int, *, show_content: bool) -> list[dict[str, Any]]:
    """The timeline as the console built it before it was bounded (commit a1b8cdb): every live
    message read in order, each TOOL result matched to its call, then the last
    TIMELINE_ENTRIES entries kept. The oracle of the bounded one, for histories without a round
    in flight or waiting."""
    from console import timeline as t
    from harness.history import parse_tool_calls

    out: list[dict[str, Any]] = []
    calls_by_id: dict[str, dict[str, Any]] = {}
    folded: dict[str, dict[str, Any]] = {}
    with read_only() as s:
        rows = s.execute(
            select(Message).where(Message.session_id == session_id, Message.deleted.is_(False)).order_by(Message.id)
        ).scalars()
        for m in rows:
            m.size = len(m.content or "")  # type: ignore[attr-defined]
            if m.role == Role.TOOL and str(m.tool_call_id) in folded:
                folded[str(m.tool_call_id)]["calls_answered"] += 1
                continue
            entry = t._message_entry(m, show_content)
            if m.role == Role.ASSISTANT:
                parsed = parse_tool_calls(m.tool_calls)
                parsed = parsed if isinstance(parsed, list) else []
                calls = [t._call(c, show_content) for c in parsed[:CALLS_SHOWN]]
                entry.update(kind="model_reply", tool_calls=calls)
                calls_by_id.update((str(c["tool_call_id"]), c) for c in calls)
                if len(parsed) > CALLS_SHOWN:
                    entry.update(calls_total=len(parsed), calls_answered=0)
                    folded.update((str(c["id"]), entry) for c in parsed[CALLS_SHOWN:])
            elif m.role == Role.TOOL:
                result = {
                    "message_id": m.id,
                    "size": len(m.content or ""),
                    "at": t._iso(m.created_at),
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
    return t._fold(out)


def _shown(session_id: int, *, show_content: bool) -> list[dict[str, Any]]:
    with read_only() as s:
        return timeline(s, session_id, show_content=show_content)


def _calls(prefix: str, n: int) -> list[dict[str, Any]]:
    return [
        {"id": f"{prefix}{i}", "type": "function", "function": {"name": "echo", "arguments": json.dumps({"i": i})}}
        for i in range(n)
    ]


def _round(sid: int, prefix: str, n: int, *, answered: int | None = None) -> None:
    """A model reply with ``n`` calls and the results of the first ``answered`` (all)."""
    add_message(sid, Role.ASSISTANT, f"reply {prefix}", tool_calls=_calls(prefix, n))
    for i in range(n if answered is None else answered):
        add_message(sid, Role.TOOL, "r" * (i % 5 + 1), tool_call_id=f"{prefix}{i}")


def _raw(sid: int, role: str, **columns: Any) -> int:
    """A row as old or damaged histories hold it (malformed calls, a deleted row, an orphan)."""
    values = {"session_id": sid, "role": role, "deleted": False, **columns}
    names = ", ".join(values)
    sql = f"INSERT INTO message ({names}, created_at) VALUES ({', '.join(':' + n for n in values)}, now()) RETURNING id"
    with transaction() as s:
        return int(s.execute(text(sql), values).scalar_one())


def _histories() -> dict[str, int]:
    small = make_session()
    add_message(small, Role.USER, "review the change")
    _round(small, "a", 3)
    add_message(small, Role.ASSISTANT, "done")

    long = make_session()
    for r in range(70):  # 70 rounds of 2 calls, between user turns: 140 entries and 140 results
        add_message(long, Role.USER, f"turn {r}")
        _round(long, f"r{r}-", 2)

    wide = make_session()
    add_message(wide, Role.USER, "fan out")
    _round(wide, "w", CALLS_SHOWN + 30, answered=CALLS_SHOWN + 12)  # 12 of the 30 folded calls answered
    add_message(wide, Role.USER, "and then")

    damaged = make_session()
    add_message(damaged, Role.USER, "start")
    _raw(damaged, "ASSISTANT", content="", tool_calls="[{not json")  # malformed: no calls shown
    _raw(damaged, "TOOL", content="lost", tool_call_id="nowhere")  # an orphan: its own entry
    _round(damaged, "d", 2)
    add_message(damaged, Role.TOOL, "again", tool_call_id="d1")  # a second result: the newest shown
    _raw(damaged, "USER", content="deleted", deleted=True)  # never shown
    _raw(damaged, "TOOL", content="early", tool_call_id="late0")  # before the reply naming it: orphan
    _round(damaged, "late", 1)
    return {"small": small, "long": long, "wide": wide, "damaged": damaged}


@pytest.mark.parametrize("show_content", [False, True])
def test_the_bounded_timeline_shows_what_reading_the_whole_history_showed(show_content: bool) -> None:
    for name, sid in _histories().items():
        assert _shown(sid, show_content=show_content) == _whole_history(sid, show_content=show_content), name


def test_a_history_of_more_than_100_messages_shows_the_newest_100_and_counts_the_older_ones() -> None:
    sid = make_session()
    ids = [add_message(sid, Role.USER if i % 2 == 0 else Role.ASSISTANT, f"m{i}") for i in range(TIMELINE_ENTRIES + 57)]
    shown = _shown(sid, show_content=True)
    assert [e["message_id"] for e in shown] == ids[-TIMELINE_ENTRIES:]
    assert shown[0]["earlier"] == 57 and all("earlier" not in e for e in shown[1:])
    assert shown[-1]["content"] == f"m{TIMELINE_ENTRIES + 56}"
    # Rounds whose results are TOOL messages: an entry per reply, results inside; the older
    # replies and their results counted as entries (not as messages).
    rounds = make_session()
    for r in range(TIMELINE_ENTRIES + 20):
        _round(rounds, f"x{r}-", 3)
    shown = _shown(rounds, show_content=False)
    assert len(shown) == TIMELINE_ENTRIES and shown[0]["earlier"] == 20
    assert all(e["kind"] == "model_reply" and all(c["result"] for c in e["tool_calls"]) for e in shown)


@contextmanager
def _rows_read() -> Iterator[list[int]]:
    """The rows each statement sent back, while in the block."""
    from models.db import get_engine

    counts: list[int] = []

    def note(conn: object, cursor: Any, *args: object) -> None:
        counts.append(cursor.rowcount)

    event.listen(get_engine(), "after_cursor_execute", note)
    try:
        yield counts
    finally:
        event.remove(get_engine(), "after_cursor_execute", note)


def test_a_reply_of_3000_delegations_sends_its_shown_results_and_a_count_not_3000_rows() -> None:
    sid = make_session()
    add_message(sid, Role.USER, "fan out")
    n = 3000
    with transaction() as s:
        s.execute(
            text(
                "INSERT INTO message (session_id, role, content, tool_calls, deleted, created_at)"
                " VALUES (:sid, 'ASSISTANT', '', :calls, false, now())"
            ),
            {"sid": sid, "calls": json.dumps(_calls("c", n))},
        )
        s.execute(
            text(
                "INSERT INTO message (session_id, role, content, tool_call_id, deleted, created_at)"
                " SELECT :sid, 'TOOL', 'answer', 'c' || i, false, now() FROM generate_series(0, :last) AS i"
            ),
            {"sid": sid, "last": n - 101},  # the last 100 calls are not answered yet
        )
    with _rows_read() as counts:
        shown = _shown(sid, show_content=False)
    first, reply = shown
    assert first["kind"] == "user"
    assert reply["calls_total"] == n and reply["calls_answered"] == n - 100
    assert len(reply["tool_calls"]) == CALLS_SHOWN and all(c["result"]["size"] == 6 for c in reply["tool_calls"])
    assert max(counts) <= CALLS_SHOWN + 2, counts  # the shown results and a count: never a row per result
    assert shown == _whole_history(sid, show_content=False)


def test_a_round_waiting_for_many_children_shows_its_first_calls_and_counts_every_answer() -> None:
    from models.round import PendingRound
    from tests.helpers import make_execution

    sid = make_session()
    add_message(sid, Role.USER, "fan out")
    calls = [{**c, "function": {**c["function"], "name": "delegate"}} for c in _calls("p", CALLS_SHOWN + 30)]
    inline = {f"p{i}": "inline answer" for i in range(CALLS_SHOWN + 10, CALLS_SHOWN + 15)}  # 5 inline
    with transaction() as s:
        rnd = PendingRound(session_id=sid, tool_calls=calls, inline_results=inline)
        s.add(rnd)
        s.flush()
        round_id = rnd.id
    for i in range(CALLS_SHOWN + 10):  # 60 delegated: the 50 shown and 10 of the rest
        make_execution(sid, tool_call_id=f"p{i}", pending_round_id=round_id)
    with _rows_read() as counts:
        _user, waiting = _shown(sid, show_content=False)
    assert waiting["kind"] == "waiting_for_children" and waiting["round_id"] == round_id
    assert len(waiting["tool_calls"]) == CALLS_SHOWN and all(c["execution"] for c in waiting["tool_calls"])
    assert waiting["calls_total"] == CALLS_SHOWN + 30
    assert waiting["calls_answered"] == CALLS_SHOWN + 10 + 5  # every child execution and inline result
    assert max(counts) <= CALLS_SHOWN, counts  # the executions of the shown calls only


def _reads_calls(statement: str) -> bool:
    """The statement sends back a reply's calls (the text; not only its size)."""
    return "message.tool_calls" in statement.replace("octet_length(message.tool_calls)", "")


def test_a_reply_is_read_and_parsed_once_however_often_its_timeline_is_polled() -> None:
    from models.db import get_engine

    sid = make_session()
    add_message(sid, Role.USER, "fan out")
    _round(sid, "once", CALLS_SHOWN + 5)
    seen: list[str] = []

    def note(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(statement)

    event.listen(get_engine(), "before_cursor_execute", note)
    try:
        first = _shown(sid, show_content=False)
        reads_of_calls = sum(_reads_calls(st) for st in seen)
        seen.clear()
        again = _shown(sid, show_content=False)
    finally:
        event.remove(get_engine(), "before_cursor_execute", note)
    assert reads_of_calls == 1
    assert not [st for st in seen if _reads_calls(st)]  # the second poll reads no reply's calls
    assert again == first == _whole_history(sid, show_content=False)


def test_a_reply_id_used_again_after_the_tables_were_emptied_is_parsed_again() -> None:
    sid = make_session()
    reply = add_message(sid, Role.ASSISTANT, None, tool_calls=_calls("old", 2))
    assert [c["tool_call_id"] for c in _shown(sid, show_content=False)[0]["tool_calls"]] == ["old0", "old1"]
    with transaction() as s:  # the same id, calls of the same size, written later
        s.execute(text("DELETE FROM message WHERE id = :id"), {"id": reply})
        s.execute(
            text(
                "INSERT INTO message (id, session_id, role, content, tool_calls, deleted, created_at)"
                " VALUES (:id, :sid, 'ASSISTANT', NULL, :calls, false, now())"
            ),
            {"id": reply, "sid": sid, "calls": json.dumps(_calls("new", 2))},
        )
    assert [c["tool_call_id"] for c in _shown(sid, show_content=False)[0]["tool_calls"]] == ["new0", "new1"]
