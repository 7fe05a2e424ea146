"""Releases (docs/releases.md): the configuration in force stored once under its hash, each
session recording the release it started in (a child its parent's), and its rounds using that
release's prompt, model options and limits after a deploy changed AGENTS_FILE (real
PostgreSQL, scripted model over loopback HTTP, the loops run in-process step by step)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update

from harness.approval import decide
from harness.parent import run_agent
from harness.release import canonical_hash, current_definition
from harness.tools import ToolContext, tool, unregister
from harness.views import create_session
from models import AgentRelease, AgentSession, Phase, ReleaseMove, SessionType, transaction
from models.approval import Decision
from models.base import utcnow
from tests.helpers import RecordingScheduler, loop_deps, messages_of, phase_of
from tests.integration.test_approvals import requests, settle
from tests.integration.test_console_api import Serve, client
from tests.integration.test_console_api import console as console  # the fixture
from tests.types import ModelFactory

V1 = """
[agents.main]
system_prompt = "You are the main agent, version one."
temperature = 0.1
max_rounds = 5
approve = ["wire_*"]
[agents.reviewer]
system_prompt = "You are the reviewer subagent, version one."
temperature = 0.2
[[agents.main.mcp_servers]]
name = "files"
url = "http://127.0.0.1:9/mcp"
headers = { Authorization = "Bearer sk-not-stored-1234" }
"""

V2 = """
[agents.main]
system_prompt = "You are the main agent, version two."
temperature = 0.9
max_rounds = 1
approve = ["wire_*"]
[agents.reviewer]
system_prompt = "You are the reviewer subagent, version two."
temperature = 0.8
"""


class Deploy:
    """Writes AGENTS_FILE as a deploy would, and makes this process read it again."""

    def __init__(self, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path = path
        monkeypatch.setenv("AGENTS_FILE", str(path))

    def to(self, text: str) -> None:
        from harness.agents import _load
        from settings import get_settings

        self.path.write_text(text, encoding="utf-8")
        get_settings.cache_clear()
        _load.cache_clear()


@pytest.fixture
def deploy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Deploy]:
    unregister("wire_money")

    @tool
    def wire_money(ctx: ToolContext, amount: int) -> str:
        """Wire money."""
        return f"wired {amount}"

    d = Deploy(tmp_path / "agents.toml", monkeypatch)
    d.to(V1)
    yield d
    unregister("wire_money")
    monkeypatch.undo()
    d.to("")


SCRIPT = [
    {
        "when": {"system_contains": "main agent, version one", "turn": 0},
        "reply": {"tool_calls": [{"name": "wire_money", "arguments": {"amount": 5}}]},
    },
    {"when": {"system_contains": "main agent, version one", "turn": 1}, "reply": {"content": "answered under v1"}},
    {"when": {"system_contains": "main agent, version two"}, "reply": {"content": "answered under v2"}},
]


def release_of(sid: int) -> int | None:
    with transaction() as s:
        return s.execute(select(AgentSession.release_id).where(AgentSession.id == sid)).scalar_one()


def answers(sid: int) -> list[str]:
    return [m.content for m in messages_of(sid) if m.role == "ASSISTANT" and m.content]


ANSWER = [{"when": {"system_contains": "main agent"}, "reply": {"content": "ok"}}]


def started(model_url: str, text: str) -> int:
    """A session created and run once: its first run records the worker's release."""
    sid = create_session("main", text)
    assert release_of(sid) is None  # the creating process (an API, a CLI) decides nothing
    assert run_agent(sid, 0, loop_deps(model_url)) == "waiting_user"
    return sid


def test_the_configuration_in_force_is_stored_once_under_its_hash_without_secrets(
    model_factory: ModelFactory, deploy: Deploy
) -> None:
    url = model_factory(ANSWER).base_url
    first = started(url, "a")
    second = started(url, "b")
    assert release_of(first) == release_of(second) is not None
    with transaction() as s:
        row = s.execute(select(AgentRelease).where(AgentRelease.id == release_of(first))).scalar_one()
    assert row.content_hash == canonical_hash(row.definition) == canonical_hash(current_definition())
    main = row.definition["agents"]["main"]
    assert main["system_prompt"] == "You are the main agent, version one."
    assert (main["max_rounds"], main["model_options"]["temperature"], main["approve"]) == (5, 0.1, ["wire_*"])
    assert main["mcp_servers"][0]["header_names"] == ["Authorization"]
    assert "sk-not-stored" not in json.dumps(row.definition)
    wire = row.definition["tools"]["wire_money"]
    assert wire["spec"]["function"]["name"] == "wire_money"
    assert (wire["read_only"], wire["idempotent"], wire["requires_approval"]) == (False, False, False)
    deploy.to(V2)
    third = started(url, "c")
    assert release_of(third) not in (None, release_of(first))
    deploy.to(V1)  # back to v1: the same content, the same row
    assert release_of(started(url, "d")) == release_of(first)
    with transaction() as s:
        hashes = [h for (h,) in s.execute(select(AgentRelease.content_hash))]
    assert len(hashes) == len(set(hashes))


def test_a_session_resumed_after_a_deploy_keeps_its_releases_prompt_and_options_and_a_new_one_takes_the_new(
    model_factory: ModelFactory, deploy: Deploy
) -> None:
    model = model_factory(SCRIPT)
    deps = loop_deps(model.base_url, RecordingScheduler())
    old = create_session("main", "go")
    assert run_agent(old, 0, deps) == "waiting_approval"  # the worker stops mid-session
    deploy.to(V2)  # new prompt, new temperature, max_rounds 1
    (req,) = requests()
    assert decide(old, req.call_id, Decision(True, "alice", ""), deps.scheduler).resumed
    settle(deps)
    # Round 2 ran although v2 allows one round: v1's max_rounds (5) is the session's.
    assert answers(old) == ["answered under v1"] and phase_of(old) == Phase.WAITING_USER
    new = create_session("main", "go")
    assert run_agent(new, 0, deps) == "waiting_user"
    assert answers(new) == ["answered under v2"]
    assert [r["temperature"] for r in model.received()] == [0.1, 0.1, 0.9]


def test_a_child_takes_its_parents_release_and_runs_on_it_after_a_deploy(
    model_factory: ModelFactory, deploy: Deploy
) -> None:
    model = model_factory(
        [
            {
                "when": {"system_contains": "main agent, version one", "turn": 0},
                "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "t"}}]},
            },
            {"when": {"system_contains": "main agent, version one", "turn": 1}, "reply": {"content": "{tool_results}"}},
            {"when": {"system_contains": "reviewer subagent, version one"}, "reply": {"content": "child on v1"}},
            {"when": {"system_contains": "reviewer subagent, version two"}, "reply": {"content": "child on v2"}},
        ]
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    parent = create_session("main", "go")
    assert run_agent(parent, 0, deps) == "yielded"  # the child exists, not yet run
    parent_release = release_of(parent)
    assert parent_release is not None
    with transaction() as s:
        child = s.execute(select(AgentSession).where(AgentSession.session_type == SessionType.SUBAGENT)).scalar_one()
    assert child.release_id == parent_release
    deploy.to(V2)
    settle(deps)
    assert answers(child.id) == ["child on v1"]
    assert "child on v1" in answers(parent)[-1]
    assert [r["temperature"] for r in model.received()] == [0.1, 0.2, 0.1]
    with transaction() as s:
        unpinned = select(func.count()).select_from(AgentSession).where(AgentSession.release_id.is_(None))
        assert s.execute(unpinned).scalar() == 0


def test_a_tool_of_the_release_that_the_deploy_removed_gets_tool_unavailable_never_a_crash(
    model_factory: ModelFactory, deploy: Deploy
) -> None:
    @tool
    def old_lookup(ctx: ToolContext, order: str) -> str:
        """Look an order up (removed by the next deploy)."""
        return f"found {order}"

    deploy.to(V1.replace('approve = ["wire_*"]', 'approve = ["wire_*", "old_*"]'))
    model = model_factory(
        [
            {
                "when": {"system_contains": "main agent, version one", "turn": 0},
                "reply": {"tool_calls": [{"name": "old_lookup", "arguments": {"order": "A-1"}}]},
            },
            {"when": {"system_contains": "main agent, version one", "turn": 1}, "reply": {"content": "{tool_results}"}},
        ]
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_approval"
    unregister("old_lookup")  # the new deploy's code has no such tool
    # A configuration no test stored before: a newer release than the session's (one equal to
    # an older release is a rollback, whose workers leave the newer releases' sessions waiting).
    deploy.to(V2.replace("temperature = 0.9", "temperature = 0.7"))
    (req,) = requests()
    assert decide(sid, req.call_id, Decision(True, "alice", ""), deps.scheduler).resumed
    settle(deps)
    tools = [m.content for m in messages_of(sid) if m.role == "TOOL"]
    assert tools == [f"tool_unavailable: not in this deployment (release {release_of(sid)})"]
    assert phase_of(sid) == Phase.WAITING_USER


def test_the_releases_command_lists_each_release_with_its_live_sessions(
    model_factory: ModelFactory, deploy: Deploy, db: str
) -> None:
    from harness.cancel import cancel_session
    from tests.integration.test_approvals import cli

    url = model_factory(ANSWER).base_url
    v1 = [started(url, "a"), started(url, "b")]
    deploy.to(V2)
    v2 = started(url, "c")
    cancel_session(v1[1])
    from models.presence import WorkerPresence, record_seen

    # Which workers run which release: two alive on v2, one on v1, one silent on v1.
    with transaction() as s:
        for name, release in (("w2a@h", release_of(v2)), ("w2b@h", release_of(v2)), ("w1@h", release_of(v1[0]))):
            record_seen(s, name=name, hostname="h", pid=1, started_at=utcnow(), release_id=release)
        record_seen(s, name="old@h", hostname="h", pid=2, started_at=utcnow(), release_id=release_of(v1[0]))
        s.execute(
            update(WorkerPresence)
            .where(WorkerPresence.name == "old@h")
            .values(last_seen_at=utcnow() - timedelta(days=1))
        )
    listed = cli("releases", "--json", env={"DATABASE_URL": db})
    assert listed.returncode == 0, listed.stderr
    rows = {r["id"]: r for r in json.loads(listed.stdout)}
    assert rows[release_of(v2)]["workers"] == ["w2a@h", "w2b@h"]
    assert rows[release_of(v1[0])]["workers"] == ["w1@h"]  # the silent one is not counted
    assert rows[release_of(v1[0])]["live_sessions"] == 1  # the cancelled one is not live
    assert rows[release_of(v2)]["live_sessions"] == 1
    assert rows[release_of(v2)]["agents"] == ["main", "reviewer"]
    assert len(rows[release_of(v2)]["content_hash"]) == 64
    text = cli("releases", env={"DATABASE_URL": db})
    assert text.returncode == 0 and f"release {release_of(v2)} " in text.stdout
    assert "workers w2a@h, w2b@h" in text.stdout
    # The metric: live sessions pinned to each release (the cancelled one is not counted).
    assert {k: v for k, v in release_metric("sessions_by_release").items() if v} == {
        str(release_of(v1[0])): 1.0,
        str(release_of(v2)): 1.0,
    }


def test_a_tool_whose_schema_changed_in_the_deploy_gets_tool_unavailable_and_is_not_offered(
    model_factory: ModelFactory, deploy: Deploy
) -> None:
    ran: list[str] = []

    @tool
    def old_lookup(ctx: ToolContext, order: str) -> str:
        """Look an order up."""
        ran.append("v1")
        return f"found {order}"

    deploy.to(V1.replace('approve = ["wire_*"]', 'approve = ["wire_*", "old_*"]'))
    model = model_factory(
        [
            {
                "when": {"system_contains": "main agent, version one", "turn": 0},
                "reply": {"tool_calls": [{"name": "old_lookup", "arguments": {"order": "A-1"}}]},
            },
            {"when": {"system_contains": "main agent, version one", "turn": 1}, "reply": {"content": "{tool_results}"}},
            {"when": {"system_contains": "main agent, version two"}, "reply": {"content": "v2"}},
        ]
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_approval"
    unregister("old_lookup")

    @tool
    def old_lookup(ctx: ToolContext, order: int, region: str) -> str:  # type: ignore[no-redef]  # noqa: F811
        """Look an order up (the deploy changed its arguments)."""
        ran.append("v2")
        return f"found {order} in {region}"

    try:
        deploy.to(V2)
        (req,) = requests()
        assert decide(sid, req.call_id, Decision(True, "alice", ""), deps.scheduler).resumed
        settle(deps)
        tools = [m.content for m in messages_of(sid) if m.role == "TOOL"]
        assert tools == [f"tool_unavailable: not in this deployment (release {release_of(sid)})"]
        assert ran == [] and phase_of(sid) == Phase.WAITING_USER
        offered = [r["tools"] for r in model.received()]
        assert "old_lookup" in offered[0] and "old_lookup" not in offered[1]  # never under the new schema
        new = create_session("main", "go")
        assert run_agent(new, 0, deps) == "waiting_user"
        assert "old_lookup" in model.received()[-1]["tools"]  # a new session has the new schema's tool
        with transaction() as s:
            definition = s.execute(select(AgentRelease.definition).where(AgentRelease.id == release_of(new))).scalar()
        assert set(definition["tools"]["old_lookup"]["spec"]["function"]["parameters"]["properties"]) == {
            "order",
            "region",
        }
    finally:
        unregister("old_lookup")


def moves() -> list[ReleaseMove]:
    with transaction() as s:
        return list(s.execute(select(ReleaseMove).order_by(ReleaseMove.id)).scalars())


def test_policy_latest_moves_a_session_to_the_new_release_at_its_next_round_boundary_never_mid_round(
    model_factory: ModelFactory, deploy: Deploy, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_factory(
        [
            {
                "when": {"system_contains": "main agent, version one", "turn": 0},
                "reply": {"tool_calls": [{"name": "wire_money", "arguments": {"amount": 5}}]},
            },
            {"when": {"system_contains": "main agent, version one"}, "reply": {"content": "answered under v1"}},
            {"when": {"system_contains": "main agent, version two"}, "reply": {"content": "answered under v2"}},
        ]
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_approval"  # a round in flight on v1
    v1 = release_of(sid)
    monkeypatch.setenv("AGENT_RELEASE_POLICY", "latest")
    deploy.to(V2.replace("temperature = 0.9", "temperature = 0.6"))  # a release no test stored before
    (req,) = requests()
    assert decide(sid, req.call_id, Decision(True, "alice", ""), deps.scheduler).resumed
    settle(deps)
    # The round in flight ran whole on v1 (its tool ran); the next round asked the model on v2.
    assert [m.content for m in messages_of(sid) if m.role == "TOOL"] == ["wired 5"]
    assert answers(sid) == ["answered under v2"]
    assert [r["temperature"] for r in model.received()] == [0.1, 0.6]
    v2 = release_of(sid)
    assert v2 not in (None, v1)
    (move,) = moves()
    assert (move.session_id, move.from_release_id, move.to_release_id, move.reason) == (sid, v1, v2, "latest")


def test_sessions_upgrade_moves_trees_at_their_next_round_boundary_and_denies_approvals_of_tools_the_target_lacks(
    model_factory: ModelFactory, deploy: Deploy, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli.main import main
    from models.operator_action import OperatorAction

    def cli(*argv: str) -> tuple[int, str, str]:
        """The command in this process (its configuration is the test's: the v2 deploy)."""
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    @tool
    def old_lookup(ctx: ToolContext, order: str) -> str:
        """Look an order up (removed by the next deploy)."""
        return f"found {order}"

    deploy.to(V1.replace('approve = ["wire_*"]', 'approve = ["wire_*", "old_*"]'))
    model = model_factory(
        [
            {
                "when": {"system_contains": "main agent, version one", "user_contains": "look", "turn": 0},
                "reply": {"tool_calls": [{"name": "old_lookup", "arguments": {"order": "A-1"}}]},
            },
            {
                "when": {"system_contains": "main agent, version one", "user_contains": "review", "turn": 0},
                "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "t"}}]},
            },
            {"when": {"system_contains": "reviewer subagent, version one"}, "reply": {"content": "child on v1"}},
            {"when": {"system_contains": "main agent, version one"}, "reply": {"content": "answered under v1"}},
            {"when": {"system_contains": "main agent, version two"}, "reply": {"content": "answered under v2"}},
        ]
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    looking, reviewing = create_session("main", "look"), create_session("main", "review")
    assert run_agent(looking, 0, deps) == "waiting_approval"
    assert run_agent(reviewing, 0, deps) == "yielded"  # its child exists, not yet run
    v1 = release_of(looking)
    unregister("old_lookup")
    deploy.to(V2.replace("temperature = 0.9", "temperature = 0.5"))  # a release no test stored before
    with transaction() as s:
        from harness.release import current_release_id

        v2 = current_release_id(s)
    upgrade = ("sessions", "upgrade", "--to", str(v2), "--from", str(v1), "--json")

    code, out, err = cli(*upgrade, "--dry-run")
    assert code == 0, err
    planned = json.loads(out)
    assert [r["session_id"] for r in planned["sessions"]] == [looking, reviewing]
    ((orphan),) = planned["orphaned_approvals"]
    assert (orphan["session_id"], orphan["tool"], orphan["denied"]) == (looking, "old_lookup", False)
    assert f"release {v2}" in orphan["reason"]

    code, out, err = cli(*upgrade)
    assert code == 1 and "--deny-missing" in err
    with transaction() as s:
        marked = select(func.count()).select_from(AgentSession).where(AgentSession.release_target_id.is_not(None))
        assert s.execute(marked).scalar() == 0  # nothing moved, nothing denied
    assert [r.status for r in requests()] == ["PENDING"]

    code, out, err = cli(*upgrade, "--deny-missing", "--by", "ops")
    assert code == 0, err
    assert [r["outcome"] for r in json.loads(out)["sessions"]] == ["scheduled", "scheduled"]
    (req,) = requests()
    assert (req.status, req.decided_by) == ("DENIED", "ops") and "not in release" in (req.reason or "")
    with transaction() as s:
        actions = s.execute(select(OperatorAction.actor, OperatorAction.action, OperatorAction.outcome)).all()
    assert sorted(actions) == [
        ("ops", "deny", "decided"),
        ("ops", "upgrade", "scheduled"),
        ("ops", "upgrade", "scheduled"),
    ]
    assert release_of(looking) == v1  # marked, not moved: its round is still open

    # The denied round ends on v1; the next round asks the model on v2.
    with transaction() as s:
        epoch = s.execute(select(AgentSession.epoch).where(AgentSession.id == looking)).scalar_one()
    assert run_agent(looking, epoch, deps) == "waiting_user"
    assert answers(looking) == ["answered under v2"]
    assert next(m.content for m in messages_of(looking) if m.role == "TOOL").startswith("denied by an approver")
    # The delegating round ends on v1 (its child ran on v1); the tree moves together after it.
    settle(deps)
    with transaction() as s:
        child = s.execute(select(AgentSession).where(AgentSession.parent_session_id == reviewing)).scalar_one()
    assert answers(child.id) == ["child on v1"]
    assert answers(reviewing)[-1] == "answered under v2"
    assert release_of(looking) == release_of(reviewing) == release_of(child.id) == v2
    assert sorted((m.session_id, m.sessions, m.reason) for m in moves()) == [
        (looking, 1, "upgrade"),
        (reviewing, 2, "upgrade"),
    ]


def run_resumed(deps: Any) -> list[str]:
    """Run every parent the scheduler was asked to resume; their outcomes."""
    sched = deps.scheduler
    done = []
    while sched.resumed:
        sid, epoch = sched.resumed.pop(0)
        done.append(str(run_agent(sid, epoch, deps)))
    return done


def release_metric(name: str) -> dict[str, float]:
    """``agent_recovery_<name>{release="R"}`` as scraped, by release."""
    from prometheus_client import generate_latest

    from recovery.metrics import build_registry

    text = generate_latest(build_registry()).decode()
    found = re.findall(rf'^agent_recovery_{name}\{{release="(\d+)"\}} (\S+)$', text, re.M)
    return {r: float(v) for r, v in found}


def waiting_metric() -> dict[str, float]:
    return release_metric("sessions_waiting_for_release")


def test_a_session_of_a_newer_release_is_left_for_a_worker_of_it_and_fails_only_after_release_wait_seconds(
    model_factory: ModelFactory, deploy: Deploy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers that differ in their tool modules (one has ``new_tool``): a rollback to the
    older one leaves the newer release's sessions waiting, never failed, until a worker of that
    release runs them; one left waiting RELEASE_WAIT_SECONDS ends FAILED release_unavailable."""
    from harness.views import snapshot
    from tests.integration.test_approvals import a_scan_after_every_lease_lapsed

    model = model_factory(
        [
            {"when": {"user_contains": "warm"}, "reply": {"content": "ok"}},
            {"when": {"turn": 0}, "reply": {"tool_calls": [{"name": "wire_money", "arguments": {"amount": 5}}]}},
            {"when": {"turn": 1}, "reply": {"content": "{tool_results}"}},
        ]
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    deploy.to(V1.replace("temperature = 0.1", "temperature = 0.3"))  # a release no test stored before
    old = release_of(started(model.base_url, "warm"))  # the older worker's release, stored first

    @tool
    def new_tool(ctx: ToolContext, text: str) -> str:
        """A tool only the newer deploy's code has."""
        return text

    try:
        waiting, expiring = create_session("main", "go"), create_session("main", "go")
        assert run_agent(waiting, 0, deps) == run_agent(expiring, 0, deps) == "waiting_approval"
        newer = release_of(waiting)
        assert newer is not None and old is not None and newer > old
        unregister("new_tool")  # rolled back: the workers that resume them lack new_tool
        for sid in (waiting, expiring):
            (req,) = [r for r in requests() if r.session_id == sid]
            assert decide(sid, req.call_id, Decision(True, "alice", ""), deps.scheduler).resumed
        asked = len(model.received())
        assert run_resumed(deps) == ["waiting_release", "waiting_release"]
        assert len(model.received()) == asked  # nothing ran: no tool, no model request
        assert [m for m in messages_of(waiting) if m.role == "TOOL"] == []
        assert phase_of(waiting) == Phase.RUNNING
        with transaction() as s:
            shown = snapshot(s, waiting)
        assert shown is not None and shown["release"]["id"] == newer
        assert shown["release"]["waiting_for_worker_since"] is not None
        assert waiting_metric() == {str(newer): 2.0}

        # Another pass of an older worker: still waiting. One waited past RELEASE_WAIT_SECONDS: FAILED.
        monkeypatch.setenv("RELEASE_WAIT_SECONDS", "60")
        deploy.to(V1.replace("temperature = 0.1", "temperature = 0.3"))  # the settings read again
        with transaction() as s:
            since = utcnow() - timedelta(seconds=61)
            s.execute(update(AgentSession).where(AgentSession.id == expiring).values(release_wait_since=since))
        a_scan_after_every_lease_lapsed(deps)
        assert sorted(run_resumed(deps)) == ["failed", "waiting_release"]
        with transaction() as s:
            row = s.execute(select(AgentSession).where(AgentSession.id == expiring)).scalar_one()
        assert (row.phase, row.failure_code) == (Phase.FAILED, "release_unavailable")

        # A worker of the newer release returns: the session runs, once.
        @tool
        def new_tool(ctx: ToolContext, text: str) -> str:  # type: ignore[no-redef]
            """A tool only the newer deploy's code has."""
            return text

        a_scan_after_every_lease_lapsed(deps)
        assert run_resumed(deps) == ["waiting_user"]
        assert [m.content for m in messages_of(waiting) if m.role == "TOOL"] == ["wired 5"]
        assert answers(waiting) == ["wired 5"]
        with transaction() as s:
            shown = snapshot(s, waiting)
        assert shown is not None and shown["release"]["waiting_for_worker_since"] is None
        assert waiting_metric() == {}
    finally:
        unregister("new_tool")


def test_the_console_shows_a_sessions_release_and_the_releases_still_in_use(
    model_factory: ModelFactory, deploy: Deploy, console: Serve
) -> None:
    url = model_factory(ANSWER).base_url
    old = started(url, "a")
    deploy.to(V2.replace("temperature = 0.9", "temperature = 0.4"))  # a release no test stored before
    new = started(url, "b")
    with transaction() as s:
        s.execute(update(AgentSession).where(AgentSession.id == new).values(release_wait_since=utcnow()))
    base = console()
    http = client(base)
    shown = http.get(f"{base}/api/sessions/{new}", timeout=10).json()["release"]
    assert shown["id"] == release_of(new) and shown["waiting_for_worker_since"] is not None
    page = http.get(f"{base}/sessions/{new}", timeout=10).text
    assert f'Runs on release <a href="/releases#release-{release_of(new)}">' in page
    assert f"Waiting for a worker of release {release_of(new)}" in page
    listed = http.get(f"{base}/api/releases", timeout=10).json()
    assert listed["in_use"] == sorted({release_of(old), release_of(new)})
    assert f'id="release-{release_of(old)}"' in http.get(f"{base}/releases", timeout=10).text


def test_a_worker_killed_right_after_a_move_leaves_the_session_on_the_new_release_with_its_round_run_once(
    model_factory: ModelFactory, deploy: Deploy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crashpoints import InjectedKill, armed_fault
    from tests.integration.test_approvals import a_scan_after_every_lease_lapsed

    model = model_factory(
        [
            {
                "when": {"system_contains": "main agent, version one", "turn": 0},
                "reply": {"tool_calls": [{"name": "wire_money", "arguments": {"amount": 5}}]},
            },
            {"when": {"system_contains": "main agent, version two"}, "reply": {"content": "answered under v2"}},
        ]
    )
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_approval"
    v1 = release_of(sid)
    monkeypatch.setenv("AGENT_RELEASE_POLICY", "latest")
    deploy.to(V2.replace("temperature = 0.9", "temperature = 0.65"))  # a release no test stored before
    (req,) = requests()
    with armed_fault("release.after_move", kill=True), pytest.raises(InjectedKill):
        decide(sid, req.call_id, Decision(True, "alice", ""), deps.scheduler)
        settle(deps)
    assert release_of(sid) not in (None, v1)  # the move is committed
    assert len(model.received()) == 1  # the model was not asked on v2 yet
    a_scan_after_every_lease_lapsed(deps)
    assert run_resumed(deps) == ["waiting_user"]
    assert [m.content for m in messages_of(sid) if m.role == "TOOL"] == ["wired 5"]  # once
    assert answers(sid) == ["answered under v2"]
    assert len(moves()) == 1


def delegating_to_a_reviewer(answer: str) -> list[dict[str, Any]]:
    """A script: a warm-up answer, ``main`` delegating once to ``reviewer``, then answering
    ``answer``; the reviewer answers "child done"."""
    return [
        {"when": {"user_contains": "warm"}, "reply": {"content": "ok"}},
        {
            "when": {"system_contains": "main agent", "turn": 0},
            "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "t"}}]},
        },
        {"when": {"system_contains": "main agent", "turn": 1}, "reply": {"content": answer}},
        {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "child done"}},
    ]


def test_a_child_of_a_newer_release_waits_for_a_worker_of_it_and_its_result_is_delivered_once(
    model_factory: ModelFactory, deploy: Deploy
) -> None:
    from tests.helpers import drive

    model = model_factory(delegating_to_a_reviewer("{tool_results}"))
    deps = loop_deps(model.base_url, RecordingScheduler())
    deploy.to(V1.replace("temperature = 0.1", "temperature = 0.35"))  # a release no test stored before
    started(model.base_url, "warm")  # the older worker's release, stored first

    @tool
    def new_tool(ctx: ToolContext, text: str) -> str:
        """A tool only the newer deploy's code has."""
        return text

    try:
        parent = create_session("main", "go")
        assert run_agent(parent, 0, deps) == "yielded"  # the child exists on the newer release
        unregister("new_tool")  # rolled back before the child ran
        asked = len(model.received())
        settle(deps)
        with transaction() as s:
            child = s.execute(select(AgentSession).where(AgentSession.parent_session_id == parent)).scalar_one()
        assert child.release_wait_since is not None and answers(child.id) == []
        assert len(model.received()) == asked  # the child asked nothing

        @tool
        def new_tool(ctx: ToolContext, text: str) -> str:  # type: ignore[no-redef]
            """A tool only the newer deploy's code has."""
            return text

        drive(model.base_url, deps=deps)  # the scan recovers the execution; this worker has the tool
        assert answers(child.id) == ["child done"]
        (delivered,) = [m.content for m in messages_of(parent) if m.role == "TOOL"]  # once
        assert json.loads(delivered)["result"] == "child done"
        assert phase_of(parent) == Phase.WAITING_USER
        with transaction() as s:
            row = s.execute(select(AgentSession).where(AgentSession.id == child.id)).scalar_one()
        assert row.release_wait_since is None
    finally:
        unregister("new_tool")


def test_a_child_of_a_newer_release_left_waiting_past_release_wait_seconds_fails_and_its_parent_gets_that_once(
    model_factory: ModelFactory, deploy: Deploy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child's give-up path: no worker of its release came back within RELEASE_WAIT_SECONDS;
    its execution ends FAILED release_unavailable and that failure reaches the parent once (one
    TOOL message; the parent, of that release too, waits in turn and answers once a worker of it
    returns), with the delivery invariants holding."""
    from models import ExecutionStatus, SubagentExecution
    from recovery.invariants import check_all
    from tests.helpers import drive
    from tests.integration.test_approvals import a_scan_after_every_lease_lapsed

    model = model_factory(delegating_to_a_reviewer("parent saw: {tool_results}"))
    deps = loop_deps(model.base_url, RecordingScheduler())
    settings_text = V1.replace("temperature = 0.1", "temperature = 0.45")  # a release no test stored before
    deploy.to(settings_text)
    started(model.base_url, "warm")  # the older worker's release, stored first

    @tool
    def new_tool(ctx: ToolContext, text: str) -> str:
        """A tool only the newer deploy's code has."""
        return text

    try:
        parent = create_session("main", "go")
        assert run_agent(parent, 0, deps) == "yielded"  # the child exists on the newer release
    finally:
        unregister("new_tool")  # rolled back before the child ran; no worker of it returns
    settle(deps)
    with transaction() as s:
        child = s.execute(select(AgentSession).where(AgentSession.parent_session_id == parent)).scalar_one()
    assert child.release_wait_since is not None and phase_of(parent) == Phase.RUNNING

    monkeypatch.setenv("RELEASE_WAIT_SECONDS", "60")
    deploy.to(settings_text)  # the settings read again
    with transaction() as s:
        since = utcnow() - timedelta(seconds=61)
        s.execute(update(AgentSession).where(AgentSession.id == child.id).values(release_wait_since=since))
    a_scan_after_every_lease_lapsed(deps)
    settle(deps)  # the child gives up; its failure is delivered; the parent (v2 too) waits
    with transaction() as s:
        ex = s.execute(select(SubagentExecution).where(SubagentExecution.child_session_id == child.id)).scalar_one()
    assert ex.status == ExecutionStatus.FAILED and "no worker of release" in (ex.error or "")
    assert answers(child.id) == []  # the child never asked the model
    (delivered,) = [m.content for m in messages_of(parent) if m.role == "TOOL"]  # once
    assert "no worker of release" in delivered
    assert phase_of(parent) == Phase.RUNNING and answers(parent) == []

    @tool
    def new_tool(ctx: ToolContext, text: str) -> str:  # type: ignore[no-redef]  # noqa: F811
        """A tool only the newer deploy's code has: a worker of the release returns."""
        return text

    try:
        a_scan_after_every_lease_lapsed(deps)
        drive(model.base_url, deps=deps)
        assert answers(parent) == [f"parent saw: {delivered}"]
        assert phase_of(parent) == Phase.WAITING_USER
        a_scan_after_every_lease_lapsed(deps)
        drive(model.base_url, deps=deps)  # a later scan delivers nothing again
    finally:
        unregister("new_tool")
    assert len([m for m in messages_of(parent) if m.role == "TOOL"]) == 1
    with transaction() as s:
        assert check_all(s, settled=True) == []


def test_a_releases_agent_is_built_once_and_again_when_the_workers_tools_or_agents_change(
    model_factory: ModelFactory, deploy: Deploy
) -> None:
    """``session_agent`` keeps a release's agent per worker configuration: the same object while
    nothing changed; a tool the worker unregisters shows as missing at once, and a deploy of the
    agents file brings the worker's approval rules into the release's agent at once."""
    from harness.release import session_agent

    sid = started(model_factory(ANSWER).base_url, "go")
    release = release_of(sid)
    with transaction() as s:
        first = session_agent(s, "main", release)
        assert session_agent(s, "main", release) is first
        assert "wire_money" not in first.release_missing
    unregister("wire_money")
    with transaction() as s:
        assert "wire_money" in session_agent(s, "main", release).release_missing
    deploy.to(V1.replace('approve = ["wire_*"]', 'approve = ["wire_*", "pay_*"]'))
    with transaction() as s:
        assert "pay_*" in session_agent(s, "main", release).approve
