"""Tail cleanup and pair lookup on RAW rows in PostgreSQL (R24)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select, update

from harness.errors import BoundaryInvalid
from harness.history import cleanup_incomplete_tail, load_raw, pair_state, validated_boundary
from models import AgentSession, Message, Role, transaction
from tests.helpers import add_message, find_complete_pair, make_session

pytestmark = pytest.mark.usefixtures("db")


def calls(*ids: str) -> list[dict[str, object]]:
    return [{"id": i, "type": "function", "function": {"name": "echo", "arguments": "{}"}} for i in ids]


def live_ids(sid: int) -> list[int]:
    with transaction() as s:
        return [m.id for m in load_raw(s, sid)]


def test_cleanup_removes_incomplete_parallel_round_and_keeps_complete_rounds() -> None:
    sid = make_session()
    u = add_message(sid, Role.USER, "q")
    a1 = add_message(sid, Role.ASSISTANT, "", tool_calls=calls("a"))
    t1 = add_message(sid, Role.TOOL, "ra", tool_call_id="a")
    a2 = add_message(sid, Role.ASSISTANT, "", tool_calls=calls("b", "c"))
    t2 = add_message(sid, Role.TOOL, "rb", tool_call_id="b")
    with transaction() as s:
        removed = cleanup_incomplete_tail(s, sid, None)
    assert removed == [a2, t2]
    assert live_ids(sid) == [u, a1, t1]
    with transaction() as s:
        assert cleanup_incomplete_tail(s, sid, None) == []


def test_cleanup_ignores_deleted_rows_and_respects_the_boundary() -> None:
    sid = make_session()
    add_message(sid, Role.USER, "old")
    old_round = add_message(sid, Role.ASSISTANT, "", tool_calls=calls("x"))  # incomplete, but before boundary
    boundary = add_message(sid, Role.ASSISTANT, "summary point")
    u = add_message(sid, Role.USER, "q")
    a = add_message(sid, Role.ASSISTANT, "", tool_calls=calls("a"))
    t = add_message(sid, Role.TOOL, "ra", tool_call_id="a")
    ghost = add_message(sid, Role.TOOL, "ghost", tool_call_id="zz")
    with transaction() as s:
        s.execute(update(Message).where(Message.id == ghost).values(deleted=True))
        s.execute(update(AgentSession).where(AgentSession.id == sid).values(compaction_boundary_message_id=boundary))
    with transaction() as s:
        b = validated_boundary(s, sid)
        assert b == boundary
        assert cleanup_incomplete_tail(s, sid, b) == []
    with transaction() as s:
        rows = {m.id: m.deleted for m in s.execute(select(Message).where(Message.session_id == sid)).scalars()}
    assert rows[old_round] is False  # before the boundary: not touched
    assert [i for i in live_ids(sid) if i > boundary] == [u, a, t]


def test_boundary_that_is_not_a_live_message_of_the_session_is_rejected() -> None:
    sid = make_session()
    other = make_session()
    foreign = add_message(other, Role.USER, "elsewhere")
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == sid).values(compaction_boundary_message_id=foreign))
    with pytest.raises(BoundaryInvalid), transaction() as s:
        validated_boundary(s, sid)
    mine = add_message(sid, Role.USER, "mine")
    with transaction() as s:
        s.execute(update(Message).where(Message.id == mine).values(deleted=True))
    with pytest.raises(BoundaryInvalid), transaction() as s:
        cleanup_incomplete_tail(s, sid, mine)


def test_find_complete_pair_on_raw_rows_tolerates_malformed_json() -> None:
    sid = make_session()
    add_message(sid, Role.USER, "q")
    with transaction() as s:
        s.add(Message(session_id=sid, role=Role.ASSISTANT, content="", tool_calls='[{"id": "call_9", ', deleted=False))
    add_message(sid, Role.TOOL, "r", tool_call_id="call_9")
    with transaction() as s:
        assert find_complete_pair(s, sid, "call_9") is None
        state = pair_state(s, sid, "call_9")
    assert len(state.broken_ids) == 2  # the malformed assistant and the TOOL after it
    a = add_message(sid, Role.ASSISTANT, "", tool_calls=calls("call_9"))
    t = add_message(sid, Role.TOOL, json.dumps({"success": True}), tool_call_id="call_9")
    with transaction() as s:
        assert find_complete_pair(s, sid, "call_9") == (a, t)


def test_pair_state_reports_assistant_only_and_orphan_tool() -> None:
    sid = make_session()
    orphan = add_message(sid, Role.TOOL, "r", tool_call_id="k")
    a = add_message(sid, Role.ASSISTANT, "", tool_calls=calls("k"))
    with transaction() as s:
        state = pair_state(s, sid, "k")
    assert not state.complete
    assert set(state.broken_ids) == {orphan, a}
