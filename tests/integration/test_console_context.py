"""Context to decide (docs/console.md, "Context"): an approval names the session's user, agent,
parent and children and links to the call in the timeline; a session's page links to its parent
and to its own pending approvals; every page can open a session by its id. A real loopback
server on the real PostgreSQL schema."""

from __future__ import annotations

from typing import Any

from models import SessionType
from tests.helpers import make_execution, make_session
from tests.integration.test_approval_display import parked as parked  # the fixture
from tests.integration.test_approvals import Runs
from tests.integration.test_approvals import runs as runs  # the fixture
from tests.integration.test_console_api import Serve, client
from tests.integration.test_console_api import console as console  # the fixture


def test_an_approval_and_its_session_link_to_each_other_to_the_call_and_to_the_family(
    console: Serve, parked: tuple[int, str, Any], runs: Runs
) -> None:
    sid, call_id, _ = parked
    child = make_session(session_type=SessionType.SUBAGENT, parent_session_id=sid, user_id="u-child")
    base = console()
    http = client(base)
    (row,) = http.get(f"{base}/api/approvals", timeout=10).json()["approvals"]
    assert row["children"] == 1
    page = http.get(f"{base}/approvals", timeout=10).text
    assert f'href="/sessions/{sid}#call-{call_id}"' in page  # the call in the timeline
    assert f'href="/sessions/{sid}#tree">1 children</a>' in page
    session_page = http.get(f"{base}/sessions/{sid}", timeout=10).text
    assert 'id="session-approvals"' in session_page
    assert f'id="call-{call_id}"' in session_page  # where the approval's link lands
    assert f'id="approval-{row["id"]}"' in session_page  # the call says it waits, and links back
    assert f'href="/approvals?session={sid}"' in session_page  # and back to the approval
    listed = http.get(f"{base}/?phase=WAITING_APPROVAL", timeout=10).text
    assert f'href="/approvals?session={sid}" class="decide"' in listed  # the list links to the decision
    child_page = http.get(f"{base}/sessions/{child}", timeout=10).text
    assert f'id="parent-link">Child of <a href="/sessions/{sid}">' in child_page
    assert http.get(f"{base}/api/sessions/{child}", timeout=10).json()["session"]["parent_session_id"] == sid


def test_every_page_opens_a_session_by_its_id(console: Serve) -> None:
    sid = make_session()
    base = console()
    http = client(base)
    for path in ("/", "/health", "/approvals", f"/sessions/{sid}"):
        assert 'id="find-session"' in http.get(f"{base}{path}", timeout=10).text, path
    found = http.get(f"{base}/?id={sid}", allow_redirects=False, timeout=10)
    assert (found.status_code, found.headers["location"]) == (303, f"/sessions/{sid}")


def test_a_childs_approval_shows_the_task_it_was_given_only_with_content_shown(
    console: Serve, parked: tuple[int, str, Any], runs: Runs
) -> None:
    sid, _, _ = parked
    make_execution(make_session(), sid, task="refund order A-1 <to the card>")  # the parked one as a child
    shown = console(show_content=True)
    (row,) = client(shown).get(f"{shown}/api/approvals", timeout=10).json()["approvals"]
    assert row["task"] == "refund order A-1 <to the card>"
    page = client(shown).get(f"{shown}/approvals", timeout=10).text
    assert f'id="task-{row["id"]}"' in page and "refund order A-1 &lt;to the card&gt;" in page
    hidden = console(show_content=False)
    (bare,) = client(hidden).get(f"{hidden}/api/approvals", timeout=10).json()["approvals"]
    assert "task" not in bare
    assert "refund order A-1" not in client(hidden).get(f"{hidden}/approvals", timeout=10).text
