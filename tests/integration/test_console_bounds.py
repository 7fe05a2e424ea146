"""What the console reads and sends stays small whatever the data (docs/console.md, "Size"): a
session's children a page at a time with the rest summarised, the whole tree's figures from
one aggregate, an unchanged session's live part answered 304, pending approvals paged and
filtered. A real loopback server, the real PostgreSQL schema."""

from __future__ import annotations

import re

from sqlalchemy import text

from console.queries import CHILDREN_PAGE
from models import ExecutionStatus, transaction
from tests.helpers import make_execution, make_session
from tests.integration.test_console_api import Serve, client
from tests.integration.test_console_api import console as console  # the fixture

#: Children of the big parent: two pages and a part of a third.
MANY = 2 * CHILDREN_PAGE + 7


def _children(parent: int, n: int) -> list[int]:
    """``n`` children of ``parent`` (one execution each, the first of them recovered once),
    in one statement each; returns their execution ids in order."""
    with transaction() as s:
        s.execute(
            text(
                """
                INSERT INTO agent_session (user_id, session_type, parent_session_id, agent_type, execution_mode,
                                           phase, epoch, started_at, updated_at)
                SELECT 'u1', 'SUBAGENT', :p, 'reviewer', 'CLOUD', 'RUNNING', 1, now(), now()
                FROM generate_series(1, :n)
                """
            ),
            {"p": parent, "n": n},
        )
        return list(
            s.execute(
                text(
                    """
                    INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type,
                        task_description, status, invocation_type, parent_tool_call_id, delivery_status,
                        total_tool_calls, rounds, prompt_tokens, completion_tokens, total_tokens, started_at,
                        epoch, resends, recoveries)
                    SELECT :p, a.id, 'reviewer', 'task', 'RUNNING', 'DELEGATE', 'call_' || a.id, 'PENDING',
                           0, 1, 0, 0, 0, now(), 1, 0, CASE WHEN a.id = min(a.id) OVER () THEN 1 ELSE 0 END
                    FROM agent_session a WHERE a.parent_session_id = :p ORDER BY a.id
                    RETURNING id
                    """
                ),
                {"p": parent},
            ).scalars()
        )


def test_a_session_with_many_children_shows_a_page_of_them_and_counts_the_whole_tree(console: Serve) -> None:
    base = console()
    http = client(base)
    parent = make_session()
    execs = _children(parent, MANY)
    d = http.get(f"{base}/api/sessions/{parent}", timeout=10).json()
    tree = d["tree"]
    assert [c["executions"][0]["id"] for c in tree["children"]] == sorted(execs)[:CHILDREN_PAGE]
    assert tree["children_total"] == MANY and tree["children_offset"] == 0
    assert tree["children_by_phase"] == {"RUNNING": MANY}
    assert d["counts"] == {"sessions": MANY + 1, "executions": MANY, "recovered": 1, "pending_delivery": MANY}
    assert d["active"] is True
    second = http.get(f"{base}/api/sessions/{parent}", params={"children_offset": CHILDREN_PAGE}, timeout=10).json()
    ids = [c["executions"][0]["id"] for c in second["tree"]["children"]]
    assert ids == sorted(execs)[CHILDREN_PAGE : 2 * CHILDREN_PAGE]
    last = http.get(f"{base}/api/sessions/{parent}", params={"children_offset": 2 * CHILDREN_PAGE}, timeout=10)
    assert len(last.json()["tree"]["children"]) == 7
    assert last.json()["counts"] == d["counts"]  # the figures are the whole tree's on every page
    live = http.get(f"{base}/sessions/{parent}/live", timeout=10).text
    assert live.count('class="node depth-1"') == CHILDREN_PAGE
    assert f"{MANY - CHILDREN_PAGE} more children" in live
    page = http.get(f"{base}/sessions/{parent}", params={"children_offset": CHILDREN_PAGE}, timeout=10).text
    assert f'data-src="/sessions/{parent}/live?children_offset={CHILDREN_PAGE}"' in page
    bad = http.get(f"{base}/api/sessions/{parent}", params={"children_offset": "-1"}, timeout=10)
    assert bad.status_code == 400


def test_a_sessions_page_costs_the_same_statements_whatever_its_children_and_reads_only_its_tree(
    console: Serve,
) -> None:
    from collections.abc import Iterator
    from contextlib import contextmanager

    from sqlalchemy import event

    from models.db import get_engine

    base = console()
    http = client(base)
    small, big = make_session(), make_session()
    _children(small, 2)
    _children(big, MANY)

    @contextmanager
    def statements() -> Iterator[list[str]]:
        seen: list[str] = []

        def note(conn: object, cursor: object, statement: str, *args: object) -> None:
            seen.append(statement)

        event.listen(get_engine(), "before_cursor_execute", note)
        try:
            yield seen
        finally:
            event.remove(get_engine(), "before_cursor_execute", note)

    counted: dict[int, list[str]] = {}
    for sid in (small, big):
        http.get(f"{base}/sessions/{sid}", timeout=10).raise_for_status()  # warm
        with statements() as seen:
            http.get(f"{base}/sessions/{sid}", timeout=10).raise_for_status()
        counted[sid] = seen
    assert len(counted[big]) == len(counted[small])  # no statement per child
    for seen in counted.values():
        # The whole tree's figures come from one recursive walk, not one walk per figure.
        assert sum("WITH RECURSIVE" in st for st in seen) == 1, [st[:80] for st in seen]
        # The children are counted by phase through the sessions' parent index (their rows only),
        # not by a join from the executions that PostgreSQL answers by reading every session.
        by_phase = [st for st in seen if "GROUP BY" in st and "agent_session.phase" in st]
        assert by_phase and all("agent_session.parent_session_id IN" in st for st in by_phase), by_phase


def test_the_live_part_grows_no_more_with_the_tree_beyond_a_page(console: Serve) -> None:
    base = console()
    http = client(base)
    small, big = make_session(), make_session()
    _children(small, CHILDREN_PAGE)
    _children(big, 10 * CHILDREN_PAGE)

    def size(sid: int) -> int:
        return len(http.get(f"{base}/sessions/{sid}/live", timeout=10).content)

    assert size(big) < size(small) * 1.1  # the extra 9 pages are one summary line


def test_an_unchanged_session_answers_304_to_its_etag_and_a_change_gives_a_new_one(console: Serve) -> None:
    base = console()
    http = client(base)
    parent = make_session()
    eid = make_execution(parent)
    first = http.get(f"{base}/sessions/{parent}/live", timeout=10)
    etag = first.headers["etag"]
    same = http.get(f"{base}/sessions/{parent}/live", headers={"If-None-Match": etag}, timeout=10)
    assert same.status_code == 304 and same.content == b""
    api = http.get(f"{base}/api/sessions/{parent}", headers={"If-None-Match": etag}, timeout=10)
    assert api.status_code == 200  # the JSON has its own tag
    with transaction() as s:
        s.execute(
            text("UPDATE subagent_execution SET status = :st WHERE id = :id"),
            {"st": ExecutionStatus.COMPLETED.value, "id": eid},
        )
    changed = http.get(f"{base}/sessions/{parent}/live", headers={"If-None-Match": etag}, timeout=10)
    assert changed.status_code == 200 and changed.headers["etag"] != etag
    assert "COMPLETED" in changed.text


def _pending_requests(n: int) -> int:
    """A parked session with ``n`` pending requests (tools ``refund`` and, every tenth,
    ``wire_money``); returns the session."""
    sid = make_session(phase=None)
    with transaction() as s:
        s.execute(text("UPDATE agent_session SET phase = 'WAITING_APPROVAL' WHERE id = :id"), {"id": sid})
        jid = s.execute(
            text(
                "INSERT INTO round_journal (session_id, epoch, status, tool_calls, refused, created_at)"
                " VALUES (:s, 1, 'OPEN', '[]', '{}', now()) RETURNING id"
            ),
            {"s": sid},
        ).scalar_one()
        s.execute(
            text(
                """
                INSERT INTO approval_request (session_id, journal_id, call_id, tool, agent_type, arguments,
                    arguments_sha256, status, requested_at, expires_at)
                SELECT :s, :j, 'call_' || i, CASE WHEN i % 10 = 0 THEN 'wire_money' ELSE 'refund' END, 'main',
                       '{"order": "A-' || i || '"}', md5(i::text), 'PENDING',
                       now() - make_interval(secs => :n - i), now() + interval '1 hour'
                FROM generate_series(1, :n) AS i
                """
            ),
            {"s": sid, "j": jid, "n": n},
        )
    return sid


def test_pending_approvals_are_paged_oldest_first_and_filtered_by_tool_agent_and_session(console: Serve) -> None:
    base = console()
    http = client(base)
    sid = _pending_requests(130)
    first = http.get(f"{base}/api/approvals", timeout=10).json()
    assert [r["call_id"] for r in first["approvals"]] == [f"call_{i}" for i in range(1, 51)]
    assert first["total"] == 130 and first["next_after"] == first["approvals"][-1]["id"]
    second = http.get(f"{base}/api/approvals", params={"after": first["next_after"]}, timeout=10).json()
    assert [r["call_id"] for r in second["approvals"]] == [f"call_{i}" for i in range(51, 101)]
    wires = http.get(f"{base}/api/approvals", params={"tool": "wire_money", "limit": 5}, timeout=10).json()
    assert [r["call_id"] for r in wires["approvals"]] == [f"call_{i}" for i in (10, 20, 30, 40, 50)]
    assert wires["total"] == 13
    assert http.get(f"{base}/api/approvals", params={"session": sid + 1}, timeout=10).json()["approvals"] == []
    assert http.get(f"{base}/api/approvals", params={"agent": "main"}, timeout=10).json()["total"] == 130
    page = http.get(f"{base}/approvals", params={"tool": "wire_money"}, timeout=10).text
    assert len(re.findall(r"<tr data-request-id=", page)) == 13
    assert "13 pending" in page


def test_the_timeline_shows_a_bounded_part_of_a_long_history_and_says_what_it_left_out(console: Serve) -> None:
    import json

    from console.timeline import CALLS_SHOWN, TIMELINE_ENTRIES
    from models import Role
    from tests.helpers import add_message

    base = console()
    http = client(base)
    sid = make_session()
    n_calls = CALLS_SHOWN + 30
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "echo", "arguments": json.dumps({"i": i})}}
        for i in range(n_calls)
    ]
    add_message(sid, Role.USER, "go")
    add_message(sid, Role.ASSISTANT, None, tool_calls=calls)
    for i in range(n_calls):
        add_message(sid, Role.TOOL, "x" * (i % 7), tool_call_id=f"c{i}")
    for i in range(TIMELINE_ENTRIES + 5):
        add_message(sid, Role.USER if i % 2 == 0 else Role.ASSISTANT, "more")
    timeline = http.get(f"{base}/api/sessions/{sid}", timeout=10).json()["timeline"]
    assert len(timeline) == TIMELINE_ENTRIES and timeline[0]["earlier"] == 7  # user + reply + 5
    assert [t["kind"] for t in timeline[-2:]] == ["model_reply", "user"]  # the newest kept
    # A session whose reply holds many calls: the first CALLS_SHOWN, the rest counted.
    other = make_session()
    add_message(other, Role.ASSISTANT, None, tool_calls=calls)
    for i in range(3):
        add_message(other, Role.TOOL, "y", tool_call_id=f"c{i}")
    (reply,) = http.get(f"{base}/api/sessions/{other}", timeout=10).json()["timeline"]
    assert len(reply["tool_calls"]) == CALLS_SHOWN
    assert reply["calls_total"] == n_calls and reply["calls_answered"] == 3
    assert reply["tool_calls"][1]["result"]["size"] == 1
    live = http.get(f"{base}/sessions/{other}/live", timeout=10).text
    assert f"30 more calls (3 of {n_calls} answered)" in live
