"""bench/scale.py --kill-at-half's verdict on the real schema: a parent answered twice, one never
answered and a tool call delivered twice are each named; a parent answered once is not."""

from __future__ import annotations

from bench._scale_probes import not_once
from harness.history import append_message
from harness.views import create_session
from models import Role, transaction


def test_not_once_names_every_parent_answered_other_than_exactly_once(db: str) -> None:
    once, twice, never, delivered_twice = (create_session("main", f"parent {i}") for i in range(4))
    with transaction() as s:
        for sid in (once, twice, twice, delivered_twice):
            append_message(s, sid, Role.ASSISTANT, "the answer")
        for _ in range(2):
            append_message(s, delivered_twice, Role.TOOL, "a child's result", tool_call_id="call-1")
    found = not_once(db, [once, twice, never, delivered_twice])
    assert found == [
        f"parent {twice}: 2 answers",
        f"parent {never}: 0 answers",
        f"parent {delivered_twice}: 2 results for tool call call-1",
    ]
