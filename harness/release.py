"""Releases: the agent configuration in force as data (models.release, docs/releases.md).

``current_release_id`` stores the configuration this worker runs (every agent of AGENTS_FILE,
every registered tool's schema and flags, MCP server entries without their header and env
values) once under the sha256 of its canonical JSON, and caches the id per database.
``session_agent`` is how a loop gets the definition of a session's agent: from the session's
release when it has one (pinned), from the worker's configuration otherwise;
``session_release`` gives a session without one the release of the worker running its first
round.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import replace
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from harness.agents import AgentDef, get_agent, load_agents
from harness.errors import UnknownAgent
from harness.model import ModelOptions
from models import ExecutionMode, get_engine, transaction
from models.db import on_dispose
from models.release import pin_session_release, release_definition, release_of, store_release

#: Bumped when the shape of a definition changes (a new key): the hash then changes with it.
DEFINITION_VERSION = 1

_lock = threading.Lock()
#: (database url, content hash) -> release id, as stored.
_ids: dict[tuple[str, str], int] = {}
#: (database url, release id) -> (content hash, definition); a release row never changes.
_definitions: dict[tuple[str, int], tuple[str, dict[str, Any]]] = {}


def forget_releases() -> None:
    """Drop this process's caches (a database emptied under it: the tests' fixtures; or dropped
    and made again under the same URL once its engines were disposed)."""
    with _lock:
        _ids.clear()
        _definitions.clear()


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
            }
            for name, tool in sorted(REGISTRY.items())
        },
    }


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
    found = _definition(s, release_id)
    if found is None:
        return get_agent(agent_type)
    content_hash, definition = found
    entry = definition.get("agents", {}).get(agent_type)
    if entry is None:
        raise UnknownAgent(f"unknown agent {agent_type!r} in release {release_id} ({content_hash[:12]})")
    tools = definition.get("tools", {})
    return _agent_from(agent_type, entry, sorted(tools), release_id, missing_tools(tools))


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
        on_incomplete=str(entry.get("on_incomplete", "wait_for_user")),
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
