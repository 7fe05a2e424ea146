"""A deploy on real worker processes (docs/releases.md): sessions started on v1 (one waiting for
an approval of a tool v2 renames, one inside a model call when its worker is killed), then v2
deployed (a changed prompt, a renamed tool, a tool that now needs approval) and the v1 worker
gone. The pinned session's later model requests carry v1's prompt and tools, a new session
v2's; the renamed tool's approved call is tool_unavailable, never run under another name. After
`sessions upgrade` the moved session's next request carries v2's prompt and tools. A rollback
to v1 workers leaves the v2 session waiting for a worker of v2 (not failed), and it resumes and
finishes when a v2 worker returns. Every tool runs and every result is delivered exactly once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models import ApprovalRequest, transaction
from tests.helpers import wait_until
from tests.types import StackFactory

pytestmark = [pytest.mark.crash, pytest.mark.timeout(240)]

V1 = """
[agents.main]
system_prompt = "You are the main agent, release one."
temperature = 0.1
approve = ["lookup_order"]
"""

V2 = """
[agents.main]
system_prompt = "You are the main agent, release two."
temperature = 0.9
approve = ["find_order"]
"""

ONE, TWO = "main agent, release one", "main agent, release two"
SCRIPT: list[dict[str, Any]] = [
    {
        "when": {"system_contains": ONE, "user_contains": "look", "turn": 0},
        "reply": {"tool_calls": [{"name": "lookup_order", "arguments": {"order": "A-1"}}]},
    },
    {
        # Slow: the v1 worker is killed inside this call.
        "when": {"system_contains": ONE, "user_contains": "wire", "turn": 0},
        "reply": {"tool_calls": [{"name": "wire", "arguments": {"amount": 5}}]},
        "delay_seconds": 5,
    },
    {"when": {"system_contains": ONE, "turn": 1}, "reply": {"content": "v1: {tool_results}"}},
    {
        "when": {"system_contains": TWO, "turn": 0},
        "reply": {"tool_calls": [{"name": "wire", "arguments": {"amount": 7}}]},
    },
    {"when": {"system_contains": TWO, "turn": 1}, "reply": {"content": "v2: {tool_results}"}},
]


def pending(sid: int) -> str | None:
    A = ApprovalRequest
    with transaction() as s:
        return s.execute(select(A.call_id).where(A.session_id == sid, A.status == "PENDING")).scalar_one_or_none()


def approve_when_asked(sid: int) -> None:
    from tasks.approval import approve

    call = wait_until(lambda: pending(sid), timeout=90, what=f"session {sid} asks for an approval")
    assert approve(sid, call, by="ops").outcome == "decided"


def tool_results(snap: dict[str, Any]) -> list[str]:
    return [m["content"] for m in snap["messages"] if m["role"] == "TOOL"]


def show(sid: int, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """``agent-recovery session show ID --json``, as an operator runs it."""
    from cli.main import main

    capsys.readouterr()
    assert main(["session", "show", str(sid), "--json"]) == 0
    shown: dict[str, Any] = json.loads(capsys.readouterr().out)
    return shown


def test_pinned_sessions_keep_v1_across_a_deploy_of_v2_upgraded_ones_move_and_a_rollback_leaves_v2_waiting(
    stack_factory: StackFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli.main import main

    (tmp_path / "v1.toml").write_text(V1, encoding="utf-8")
    (tmp_path / "v2.toml").write_text(V2, encoding="utf-8")
    runs = tmp_path / "tool-runs.log"
    v1 = {"AGENTS_FILE": str(tmp_path / "v1.toml"), "TOOL_MODULES": "tests.release_tools_v1"}
    v2 = {"AGENTS_FILE": str(tmp_path / "v2.toml"), "TOOL_MODULES": "tests.release_tools_v2"}
    stack = stack_factory(SCRIPT)
    old = stack.worker("v1", concurrency=2, RELEASE_TOOL_LOG=str(runs), **v1)
    looking = stack.submit("look the order up")
    wiring = stack.submit("wire the money")
    stack.wait_phase(looking, ("WAITING_APPROVAL",), timeout=90)
    wait_until(lambda: len(stack.model.received()) >= 2, timeout=60, what="the slow model call started")

    # The deploy: the v1 worker dies inside the slow call, a v2 worker (with the scan) starts.
    old.kill()
    assert not runs.exists()  # nothing ran on v1
    new = stack.worker("v2", concurrency=2, beat=True, RELEASE_TOOL_LOG=str(runs), **v2)
    fresh = stack.submit("wire it now")
    approve_when_asked(looking)
    # wiring's v1 call of wire waits for an approval (v2's code gates wire), fresh's too.
    for sid in (wiring, fresh):
        stack.wait_phase(sid, ("WAITING_APPROVAL",), timeout=120)
    one, two = stack.snapshot(looking)["release"]["id"], stack.snapshot(fresh)["release"]["id"]
    assert stack.snapshot(wiring)["release"]["id"] == one < two

    # An operator moves the v1 sessions to v2: wiring's round in flight ends on v1 (its wire
    # runs as v1 defined it), its next model request carries v2's prompt and tools.
    capsys.readouterr()
    assert main(["sessions", "upgrade", "--to", str(two), "--from", str(one), "--by", "ops", "--json"]) == 0
    outcomes = {r["session_id"]: r["outcome"] for r in json.loads(capsys.readouterr().out)["sessions"]}
    assert outcomes == {looking: "scheduled", wiring: "scheduled"}
    approve_when_asked(wiring)
    snaps = {sid: stack.wait_phase(sid, ("WAITING_USER",), timeout=120) for sid in (looking, wiring)}
    assert snaps[looking]["release"]["id"] == one  # no round since: it stays where it is
    assert snaps[wiring]["release"]["id"] == two and len(snaps[wiring]["release"]["moves"]) == 1

    # A rollback: only v1 workers run. fresh (v2) is left waiting for a worker of v2, not failed.
    new.stop()
    old = stack.worker("v1-again", concurrency=2, beat=True, RELEASE_TOOL_LOG=str(runs), **v1)
    approve_when_asked(fresh)
    wait_until(
        lambda: show(fresh, capsys)["release"]["waiting_for_worker_since"],
        timeout=60,
        what="fresh waits for a worker of v2",
    )
    assert show(fresh, capsys)["phase"] == "RUNNING"
    assert sorted(json.loads(line)["session_id"] for line in runs.read_text().splitlines()) == [wiring]

    # A v2 worker returns: fresh resumes and finishes there.
    old.stop()
    stack.worker("v2-again", concurrency=2, beat=True, RELEASE_TOOL_LOG=str(runs), **v2)
    snaps[fresh] = stack.wait_phase(fresh, ("WAITING_USER",), timeout=120)
    assert snaps[fresh]["release"]["waiting_for_worker_since"] is None

    # The renamed tool's approved call is reported, never run under the new name.
    assert tool_results(snaps[looking]) == [f"tool_unavailable: not in this deployment (release {one})"]
    assert tool_results(snaps[wiring]) == ["wired 5"] and tool_results(snaps[fresh]) == ["wired 7"]
    ran = [json.loads(line) for line in runs.read_text().splitlines()]
    assert sorted((r["tool"], r["session_id"]) for r in ran) == sorted([("wire", wiring), ("wire", fresh)])

    # Requests: v1's prompt (rules 0-2) with v1's tools for the pinned session (looking's last
    # round), v2's (rules 3-4) for the new one and the moved one's round after the move;
    # temperature tells each request's release.
    answered = stack.model.journal()
    assert [e["rule"] for e in answered].count(2) == 1  # looking's last round
    assert sorted(e["rule"] for e in answered if e["rule"] in (3, 4)) == [3, 4, 4]  # fresh's two, wiring's last
    assert [m["content"] for m in snaps[wiring]["messages"] if m["role"] == "ASSISTANT"][-1] == "v2: wired 5"
    temperatures = [r["temperature"] for r in stack.model.received()]
    assert temperatures.count(0.9) == 3
    for request in stack.model.received():
        if request["temperature"] == 0.1:
            assert "find_order" not in request["tools"] and "wire" in request["tools"]
        else:
            assert request["temperature"] == 0.9
            assert "find_order" in request["tools"] and "lookup_order" not in request["tools"]
    assert stack.invariants() == []
