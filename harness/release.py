"""Releases: the agent configuration in force as data (models.release, docs/releases.md).

``current_release_id`` stores the configuration this worker runs (every agent of AGENTS_FILE,
every registered tool's schema and flags, MCP server entries without their header and env
values) once under the sha256 of its canonical JSON, and caches the id per database.
``session_agent`` is how a loop gets the definition of a session's agent: from the session's
release when it has one (pinned), from the worker's configuration otherwise;
``session_release`` gives a session without one the release of the worker running its first
round. ``at_boundary`` moves a top-level session's tree to another release at a round boundary
(the policy ``latest``, or an operator's ``sessions upgrade``); ``release_needed`` says when this
worker must leave a session for a worker of its (newer) release.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import replace
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from harness.agents import AgentDef, get_agent, load_agents
from harness.errors import UnknownAgent
from harness.model import ModelOptions
from logfmt import log_event
from models import ExecutionMode, get_engine, transaction
from models.db import on_dispose
from models.release import (
    MoveReason,
    move_at_boundary,
    pin_session_release,
    release_definition,
    release_of,
    store_release,
)
from settings import get_settings

log = logging.getLogger(__name__)

#: Bumped when the shape of a definition changes (a new key): the hash then changes with it.
DEFINITION_VERSION = 1

_lock = threading.Lock()
#: (database url, content hash) -> release id, as stored.
_ids: dict[tuple[str, str], int] = {}
#: (database url, release id) -> (content hash, definition); a release row never changes.
_definitions: dict[tuple[str, int], tuple[str, dict[str, Any]]] = {}
#: (database url, release id, agent type) -> (the worker's agents and tool registry version it
#: was built against, the agent): ``session_agent`` builds a release's agent once per worker
#: configuration instead of at every take and every delegation.
_agents: dict[tuple[str, int, str], tuple[dict[str, AgentDef], int, AgentDef]] = {}


def forget_releases() -> None:
    """Drop this process's caches (a database emptied under it: the tests' fixtures; or dropped
    and made again under the same URL once its engines were disposed)."""
    with _lock:
        _ids.clear()
        _definitions.clear()
        _agents.clear()


on_dispose(forget_releases)  # engines disposed: the next use may meet a new database under the URL


def _agent_entry(agent: AgentDef) -> dict[str, Any]:
    options = agent.model_options
    return {
        "system_prompt": agent.system_prompt,
        "tools": list(agent.tools) if agent.tools is not None else None,
        "deny": list(agent.deny),
        "max_rounds": agent.max_rounds,
        "execution_mode": str(agent.execution_mode),
        "model_options": {
            "model": options.model,
            "temperature": options.temperature,
            "max_tokens": options.max_tokens,
            "max_completion_tokens": options.max_completion_tokens,
        },
        "approve": list(agent.approve),
        "approve_destructive": agent.approve_destructive,
        "on_incomplete": agent.on_incomplete,
        # Only when set: a definition without per-tool approval timeouts keeps its hash.
        **({"approval_timeout_seconds": dict(agent.approval_timeouts)} if agent.approval_timeouts else {}),
        **({"child_budget_tokens": agent.child_budget_tokens} if agent.child_budget_tokens else {}),
        # Named only when it is not the default: a release's hash is unchanged by this key.
        **({"on_budget_exhausted": agent.on_budget_exhausted} if agent.on_budget_exhausted != "stop" else {}),
        # NOTE: no header or env value: they may be (or name) secrets; their names only.
        "mcp_servers": [
            {
                "name": m.name,
                "url": m.url,
                "command": m.command,
                "args": list(m.args),
                "cwd": m.cwd,
                "env_names": sorted(k for k, _ in m.env),
                "header_names": sorted(k for k, _ in m.headers),
                "timeout_seconds": m.timeout_seconds,
                "connect_timeout_seconds": m.connect_timeout_seconds,
                "trust_annotations": m.trust_annotations,
            }
            for m in agent.mcp_servers
        ],
    }


def current_definition() -> dict[str, Any]:
    """The configuration this process runs, as a release stores it."""
    from harness.tools.registry import REGISTRY

    return {
        "version": DEFINITION_VERSION,
        "agents": {name: _agent_entry(agent) for name, agent in sorted(load_agents().items())},
        "tools": {
            name: {
                "spec": tool.spec(),
                "read_only": tool.read_only,
                "idempotent": tool.idempotent,
                "requires_approval": tool.requires_approval,
                # Only when set: a definition without them keeps its hash.
                **({"approval_rule": _qualname(tool.approval_rule)} if tool.approval_rule is not None else {}),
                **(
                    {"approval_timeout_seconds": tool.approval_timeout_seconds}
                    if tool.approval_timeout_seconds is not None
                    else {}
                ),
            }
            for name, tool in sorted(REGISTRY.items())
        },
    }


def _qualname(fn: Any) -> str:
    """A callable by name (a release stores which rule a tool had, not the code)."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def canonical_hash(definition: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON (sorted keys, no spaces) of ``definition``."""
    text = json.dumps(definition, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _database(s: Session | None) -> str:
    engine = get_engine() if s is None else s.get_bind().engine
    return engine.url.render_as_string(hide_password=True)


def current_release_id(s: Session) -> int:
    """The id of the release this process runs, stored in ``s``'s transaction at its first use
    in this database (first writer wins; the row is never changed)."""
    definition = current_definition()
    content_hash = canonical_hash(definition)
    key = (_database(s), content_hash)
    with _lock:
        found = _ids.get(key)
    if found is not None:
        return found
    release_id = store_release(s, content_hash, definition)
    # NOTE: cached once the caller's transaction commits: an insert rolled back with it would
    # otherwise leave a cached id that names no row.
    event.listen(s, "after_commit", _remember(key, release_id), once=True)
    return release_id


def session_release(s: Session, session_id: int, epoch: int) -> int | None:
    """The release of a session that has none yet, decided by its first run (the holder of
    ``epoch``, in its take's transaction): this worker's. A session records the release of the
    worker that runs it first, not of the process that created it, which may have no tool
    module loaded (an API process). None when the epoch moved on (the run stops anyway)."""
    release_id = current_release_id(s)
    if pin_session_release(s, session_id, epoch=epoch, release_id=release_id):
        return release_id
    return release_of(s, session_id)


def _remember(key: tuple[str, str], release_id: int) -> Any:
    def remember(_session: Session) -> None:
        with _lock:
            _ids[key] = release_id

    return remember


def _definition(s: Session | None, release_id: int) -> tuple[str, dict[str, Any]] | None:
    key = (_database(s), release_id)
    with _lock:
        found = _definitions.get(key)
    if found is not None:
        return found
    if s is None:
        with transaction() as own:
            found = release_definition(own, release_id)
    else:
        found = release_definition(s, release_id)
    if found is not None:
        with _lock:
            _definitions[key] = found
    return found


def session_agent(s: Session | None, agent_type: str, release_id: int | None) -> AgentDef:
    """The definition of a session's agent: its release's (system prompt, model options, limits,
    tool allow list) when the session has one, else the worker's; its approval rules are the
    release's and the worker's together (the stricter wins). The MCP
    servers (their secrets live in the worker's environment) are the worker's of the same
    name. ``s``: the caller's transaction, or None (a release not yet read by this process is
    read in a transaction of its own). Raises UnknownAgent when the release (or, without one,
    the worker) has no such agent."""
    if release_id is None:
        return get_agent(agent_type)
    from harness.tools.registry import registry_version

    # The agent depends on the release (never changed), the worker's agents (its MCP servers and
    # approval rules) and its tools (those it lacks): built again when either of the last two moved.
    key, worker, version = (_database(s), release_id, agent_type), load_agents(), registry_version()
    with _lock:
        built = _agents.get(key)
    if built is not None and built[0] is worker and built[1] == version:
        return built[2]
    found = _definition(s, release_id)
    if found is None:
        return get_agent(agent_type)
    content_hash, definition = found
    entry = definition.get("agents", {}).get(agent_type)
    if entry is None:
        raise UnknownAgent(f"unknown agent {agent_type!r} in release {release_id} ({content_hash[:12]})")
    tools = definition.get("tools", {})
    agent = _agent_from(agent_type, entry, sorted(tools), release_id, missing_tools(tools))
    with _lock:
        _agents[key] = (worker, version, agent)
    return agent


def missing_tools(release_tools: dict[str, Any]) -> frozenset[str]:
    """The tools of a release (its definition's ``tools``) that this worker cannot run as the
    release defined them: not registered, or registered with another JSON schema (the
    ``parameters`` a request offers; a changed description or flag is the same tool). A call of
    one is never run under a schema the model was not shown: it gets ``tool_unavailable``."""
    from harness.tools.registry import REGISTRY

    missing = set()
    for name, entry in release_tools.items():
        here = REGISTRY.get(name)
        if here is None or here.parameters != entry.get("spec", {}).get("function", {}).get("parameters"):
            missing.add(name)
    return frozenset(missing)


def _agent_from(
    name: str, entry: dict[str, Any], definition_tools: list[str], release_id: int, missing: frozenset[str]
) -> AgentDef:
    servers = {m["name"] for m in entry.get("mcp_servers", [])}
    approve = tuple(entry.get("approve", ()))
    approve_destructive = bool(entry.get("approve_destructive", False))
    try:
        current = get_agent(name)
        mcp = tuple(m for m in current.mcp_servers if m.name in servers)
        # NOTE: approvals fail closed: a rule the worker's configuration adds gates the calls of
        # an older release's sessions too, and one it removes still gates them (docs/approvals.md).
        approve += tuple(p for p in current.approve if p not in approve)
        approve_destructive = approve_destructive or current.approve_destructive
    except UnknownAgent:
        mcp = ()
    options = entry["model_options"]
    tools = entry.get("tools")
    if tools is None:  # "every registered tool" means every tool the release had
        tools = list(definition_tools)
    agent = AgentDef(
        name=name,
        system_prompt=entry["system_prompt"],
        tools=tuple(tools) if tools is not None else None,
        deny=tuple(entry.get("deny", ())),
        max_rounds=int(entry["max_rounds"]),
        execution_mode=ExecutionMode(entry["execution_mode"]),
        model_options=ModelOptions(
            model=options.get("model"),
            temperature=options.get("temperature"),
            max_tokens=options.get("max_tokens"),
            max_completion_tokens=options.get("max_completion_tokens"),
        ),
        approve=approve,
        approve_destructive=approve_destructive,
        approval_timeouts=tuple((k, float(v)) for k, v in (entry.get("approval_timeout_seconds") or {}).items()),
        on_incomplete=str(entry.get("on_incomplete", "wait_for_user")),
        child_budget_tokens=entry.get("child_budget_tokens"),
        on_budget_exhausted=str(entry.get("on_budget_exhausted", "stop")),
        release_id=release_id,
        release_tools=tuple(definition_tools),
        release_missing=missing,
    )
    return replace(agent, mcp_servers=mcp)


def offered_tools(agent: AgentDef, *, subagent: bool) -> tuple[str, ...]:
    """The tools ``agent``'s round offers on this worker; an ``Offered`` naming the release's
    tools this worker lacks (or has under another schema: not offered) when there are any
    (docs/releases.md)."""
    from harness.tools.registry import REGISTRY, Offered

    names = agent.tool_names(tuple(REGISTRY), subagent=subagent)
    if agent.release_id is None:
        return names
    had = agent.registered_tool_names(agent.release_tools, subagent=subagent)
    missing = frozenset(n for n in had if n in agent.release_missing)
    if not missing:
        return names
    offered = Offered(n for n in names if n not in missing)
    offered.release_id, offered.missing = agent.release_id, missing
    return offered


def latest_release(s: Session) -> int | None:
    """This worker's release when AGENT_RELEASE_POLICY is ``latest`` (sessions move to it at
    their next round boundary when it is newer than theirs); None when sessions are pinned."""
    return current_release_id(s) if get_settings().AGENT_RELEASE_POLICY == "latest" else None


def at_boundary(
    s: Session, session_id: int, *, epoch: int, agent: AgentDef, latest: int | None, target: int | None
) -> AgentDef | None:
    """At a round boundary of the top-level session held at ``epoch`` (no round of it in flight):
    move its tree to ``target`` (the release an operator set), or to ``latest`` (the policy
    ``latest``: this worker's) when that is newer (``models.release.move_at_boundary``), and
    return the session's agent as the new release defines it; None when nothing moved (the
    caller goes on with ``agent``). A release without the session's agent is never moved to: the
    session stays where it is (logged)."""
    from_release = agent.release_id
    if from_release is None:
        return None
    if target is not None and target != from_release:
        to_release, reason = target, MoveReason.UPGRADE
    elif target is None and latest is not None and latest > from_release:
        to_release, reason = latest, MoveReason.LATEST
    else:
        return None
    try:
        moved = session_agent(s, agent.name, to_release)
    except UnknownAgent:
        log_event(
            log, "release_move_refused", logging.WARNING, session_id=session_id, to_release=to_release, reason="agent"
        )
        return None
    if not move_at_boundary(
        s, session_id, epoch=epoch, from_release=from_release, to_release=to_release, reason=reason
    ):
        return None
    log_event(
        log,
        "session_release_moved",
        session_id=session_id,
        from_release=from_release,
        to_release=to_release,
        reason=str(reason),
    )
    return moved


def release_needed(s: Session, agent: AgentDef) -> int | None:
    """The release a worker of which must run this session: the session's own, when it is newer
    than this worker's and this worker cannot run every tool of it that the agent offers (a
    rolling deploy or a rollback: docs/releases.md); None when this worker serves it. A tool of
    an OLDER release that this worker lacks is a deploy that removed it: the session is served,
    and a call of that tool gets ``tool_unavailable``."""
    if agent.release_id is None or not agent.release_missing:
        return None
    had = agent.registered_tool_names(agent.release_tools, subagent=False)
    if not any(n in agent.release_missing for n in had):
        return None
    # NOTE: ids grow with first storage: a release stored after this worker's is a newer deploy
    # (a configuration deployed again finds its old row, and stays older).
    return agent.release_id if agent.release_id > current_release_id(s) else None


class ReleaseWait(StrEnum):
    """What ``wait_for_worker`` did with a session this worker must not serve."""

    WAITING = "waiting"  #: its lease lapses after a back-off: the scan resumes it (any worker's task)
    GAVE_UP = "gave_up"  #: it waited RELEASE_WAIT_SECONDS: FAILED release_unavailable
    LOST = "lost"  #: another epoch holds it: nothing written


def wait_for_worker(
    s: Session,
    session_id: int,
    *,
    epoch: int,
    release_id: int,
    since: datetime | None,
    execution_id: int | None = None,
) -> ReleaseWait:
    """In the take's transaction (the holder of ``epoch``; a child's: of its execution
    ``execution_id``), leave a session of ``release_id`` for a worker of that release: nothing of
    it runs here. Like a session waiting for the model (harness.outage) its lease is set to
    lapse after a back-off (as long as it has waited so far, within the outage's bounds) and the
    scan's ordinary step for dead work resumes it; past RELEASE_WAIT_SECONDS since it began
    waiting a parent ends FAILED ``release_unavailable`` here (a child: GAVE_UP, nothing written,
    its caller ends the execution with that reason)."""
    from harness.outage import backoff_seconds
    from models import FailureCode, Phase
    from models.base import utcnow
    from models.release import wait_for_release
    from models.session import FailureReason, release_session

    now = utcnow()
    limit = get_settings().RELEASE_WAIT_SECONDS
    if since is not None and (now - since).total_seconds() >= limit:
        log_event(log, "release_wait_gave_up", logging.WARNING, session_id=session_id, release=release_id)
        if execution_id is not None:
            return ReleaseWait.GAVE_UP
        reason = FailureReason(
            FailureCode.RELEASE_UNAVAILABLE, f"no worker of release {release_id} took it within {limit:g} s"
        )
        if not release_session(s, session_id, epoch=epoch, to_phase=Phase.FAILED, reason=reason):
            return ReleaseWait.LOST
        return ReleaseWait.GAVE_UP
    backoff = backoff_seconds(since, now)
    if not wait_for_release(s, session_id, epoch=epoch, backoff_seconds=backoff, execution_id=execution_id):
        return ReleaseWait.LOST
    log_event(
        log,
        "release_wait",
        logging.WARNING,
        session_id=session_id,
        execution_id=execution_id,
        release=release_id,
        backoff_ms=int(backoff * 1000),
    )
    return ReleaseWait.WAITING
