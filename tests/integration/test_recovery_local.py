"""LOCAL client waiting with R7 and R8 (docs/fault-model.md): a local child calls no model while
its client is away, and fails when the client never connects.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from harness import presence
from models import (
    transaction,
)
from tests.helpers import (
    drive,
    executions_of,
    invariants,
    make_local,
    messages_of,
    one_child_script,
    parent_yielded,
    rule_calls,
)
from tests.types import ModelFactory


@pytest.fixture(autouse=True)
def _db(db: str) -> None:
    pass


def test_r7_local_child_waits_for_the_client_and_then_succeeds(
    model_factory: ModelFactory, local_presence: None
) -> None:
    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    make_local(e.child_session_id)
    user = "cli"
    presence.disconnect(user)
    late = threading.Timer(1.0, presence.connect, args=(user,))
    late.start()
    drive(model.base_url)
    late.join()
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("COMPLETED", "DELIVERED")
    assert presence.is_connected(user)
    assert invariants() == []


def test_r8_local_client_never_connecting_fails_the_child_and_the_parent_continues(
    model_factory: ModelFactory,
    local_presence: None,
    short_timeout: None,
) -> None:
    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    make_local(e.child_session_id)
    presence.disconnect("cli")
    drive(model.base_url)
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("FAILED", "DELIVERED")
    assert done.result["error"] == "LOCAL client did not connect before the recovery deadline"  # type: ignore[index]
    assert rule_calls(model, 2) == 0  # the child's model was never called
    assert messages_of(sid)[-1].content.startswith("parent done")
    assert invariants() == []


def test_r7_a_local_child_shows_running_and_calls_no_model_until_the_client_connects(
    model_factory: ModelFactory, local_presence: None
) -> None:
    from harness.views import snapshot

    model = model_factory(one_child_script())
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    make_local(e.child_session_id)
    presence.disconnect("cli")
    seen: dict[str, Any] = {}

    def connect() -> None:
        seen["child_calls"] = rule_calls(model, 2)
        with transaction() as s:
            seen["phase"] = snapshot(s, e.child_session_id)["phase"]  # type: ignore[index]
        presence.connect("cli")

    timer = threading.Timer(1.5, connect)
    timer.start()
    drive(model.base_url)
    timer.join()
    assert seen == {"child_calls": 0, "phase": "RUNNING"}  # waited (no model call), shown RUNNING
    (done,) = executions_of(sid)
    assert (done.status, done.delivery_status) == ("COMPLETED", "DELIVERED")
    assert rule_calls(model, 2) == 1


def test_a_local_client_that_disconnects_mid_run_is_waited_for_before_the_next_round(
    model_factory: ModelFactory, local_presence: None
) -> None:
    """The child notices the disconnect at its next round and calls no model until
    the client is back (the wait consumes the same deadline)."""
    script = one_child_script({"tool_calls": [{"name": "wait", "arguments": {"seconds": 1.0}}]})
    script.insert(
        2, {"when": {"system_contains": "reviewer subagent", "last_role": "tool"}, "reply": {"content": "ok"}}
    )
    model = model_factory(script)
    sid, _ = parent_yielded(model.base_url)
    (e,) = executions_of(sid)
    make_local(e.child_session_id)
    presence.connect("cli")
    seen: dict[str, int] = {}

    def drop_then_return() -> None:
        presence.disconnect("cli")  # during the child's 1 s tool
        time.sleep(1.5)
        seen["final_calls_while_away"] = rule_calls(model, 2)
        presence.connect("cli")

    timer = threading.Timer(0.5, drop_then_return)
    timer.start()
    drive(model.base_url)
    timer.join()
    assert seen == {"final_calls_while_away": 0}  # no model call while the client was away
    (done,) = executions_of(sid)
    assert (done.status, done.result["result"]) == ("COMPLETED", "ok")  # type: ignore[index]
