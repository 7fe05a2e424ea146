"""Agent definitions from TOML (`AGENTS_FILE`, or the built-in default).

One table per agent: ``[agents.NAME]`` with ``system_prompt``, optional ``tools`` (allow list of
tool names: built-ins, ``@tool`` functions of TOOL_MODULES / entry points), ``deny``,
``max_rounds``, ``execution_mode`` (CLOUD | LOCAL), model options ``model``, ``temperature``,
``max_tokens``, ``max_completion_tokens`` (the o-series and gpt-5 accept only this one) (sent
as the chat-completions API names them; unset means the endpoint's default,
and ``model`` defaults to MODEL_NAME), ``mcp_servers`` (a list of tables: ``{name, url}``
for streamable HTTP, with optional ``headers``; ``{name, command, args, env, cwd}`` for a
stdio server; ``timeout_seconds`` (one call, default 60), ``connect_timeout_seconds`` (start and
``initialize``, default 10), ``trust_annotations`` for both; ``${NAME}`` in url, headers, env and
args is read from the environment) whose tools are offered as
``<name>__<tool>``; ``tools`` may name them (``travel__search``, or ``travel__*``) to offer only
those; ``approve`` (tool names or globs, ``["refund_order", "travel__book*"]``: every call of a
matching tool waits for a human decision) and ``approve_destructive`` (true: so does every MCP
tool whose ``destructiveHint`` is true or absent), ``on_incomplete`` (``wait_for_user``, the
default, or ``fail``: what a parent does when the model's answer is a refusal, filtered, cut off
or says it called tools without a call; the answer is stored and marked either way). A subagent's tools
never include ``delegate`` / ``delegate_followup`` (no recursive delegation: a child never delegates).
``approve`` globs match the built-in tools like any other (``["*"]`` gates delegations too:
the round waits before any child exists, docs/approvals.md); an entry that can match no tool
the agent may call stops the start (``load_at_start``).

``load_at_start`` is what every process calls at start: it imports the tool modules and checks
every agent's tools, so that a configuration error stops the process before it takes work.
"""

from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from harness.errors import AgentConfigError, UnknownAgent
from harness.model import ModelOptions
from harness.tools.mcp import McpServer
from models import ExecutionMode
from models.budget import BudgetLimits
from settings import get_settings

DELEGATION_TOOLS = ("delegate", "delegate_followup")
_KEYS = {
    "system_prompt",
    "tools",
    "deny",
    "max_rounds",
    "execution_mode",
    "model",
    "temperature",
    "max_tokens",
    "max_completion_tokens",
    "mcp_servers",
    "approve",
    "approve_destructive",
    "approval_timeout_seconds",
    "on_incomplete",
    "budget",
    "child_budget",
    "on_budget_exhausted",
}
#: What a parent does with an answer the model did not finish (``on_incomplete``).
ON_INCOMPLETE = ("wait_for_user", "fail")
#: What a session does when its tree's budget refuses a call (``on_budget_exhausted``).
ON_BUDGET_EXHAUSTED = ("stop", "ask")
_MCP_KEYS = {
    "name",
    "url",
    "timeout_seconds",
    "connect_timeout_seconds",
    "command",
    "args",
    "env",
    "cwd",
    "headers",
    "trust_annotations",
}
_MCP_NAME = re.compile(r"^[A-Za-z0-9-]+(?:_[A-Za-z0-9-]+)*$")

DEFAULT_AGENTS_TOML = """
[agents.main]
system_prompt = "You are the main agent. Delegate work to subagents with the delegate tool and combine results."
# Explicit: a tool module loaded later (TOOL_MODULES, an entry point, an MCP server) is never
# offered to this agent unless it is listed here, in a file of your own (AGENTS_FILE).
tools = ["delegate", "delegate_followup", "echo", "wait"]
max_rounds = 20

[agents.reviewer]
system_prompt = "You are the reviewer subagent. Review what you are given and answer with your findings."
tools = ["echo", "wait"]
max_rounds = 10

[agents.researcher]
system_prompt = "You are the researcher subagent. Research what you are asked and answer with a short summary."
tools = ["echo", "wait"]
max_rounds = 10
"""


@dataclass(frozen=True)
class AgentDef:
    name: str
    system_prompt: str
    tools: tuple[str, ...] | None  #: allow list; None means every registered tool
    deny: tuple[str, ...]
    max_rounds: int
    execution_mode: ExecutionMode
    #: Options of this agent's model calls; unset ones are left to the endpoint (model: MODEL_NAME).
    model_options: ModelOptions = field(default_factory=ModelOptions)
    mcp_servers: tuple[McpServer, ...] = ()
    #: Tool names or ``fnmatch`` globs whose calls wait for a human decision (harness.approval).
    approve: tuple[str, ...] = ()
    #: Every MCP tool whose ``destructiveHint`` is true or absent waits for a human decision.
    approve_destructive: bool = False
    #: (tool name or glob, seconds): how long a matching call's approval request waits; the first
    #: match wins over the tool's ``approval_timeout_seconds`` and APPROVAL_TIMEOUT_SECONDS.
    approval_timeouts: tuple[tuple[str, float], ...] = ()
    #: A parent's answer the model did not finish: "wait_for_user" (stored, marked, the user is
    #: next) or "fail" (stored, marked, the session FAILED with the reason). A child always fails.
    on_incomplete: str = "wait_for_user"
    #: The budget of every tree rooted at this agent (``budget = { tokens = N, usd = X,
    #: model_calls = M }``, any of the three; empty: none); ``submit --budget-*`` names another
    #: for one tree (models.budget).
    budget: BudgetLimits = field(default_factory=BudgetLimits)
    #: What one child of this agent may draw of its tree's token budget (``child_budget = {
    #: tokens = N }``), set aside when the child is created; None: no cap (models.budget).
    child_budget_tokens: int | None = None
    #: A refused reservation of a session of this agent (top-level or child): "stop" (FAILED,
    #: budget_exhausted) or "ask" (an approval request to raise the budget; harness.budget_request).
    on_budget_exhausted: str = "stop"
    #: The release this definition was read from (harness.release; None: the worker's file),
    #: and the Python tools that release had (the names a call may still use after a deploy).
    release_id: int | None = None
    release_tools: tuple[str, ...] = ()
    #: The tools of that release this worker cannot run as the release defined them: not
    #: registered here, or registered with another JSON schema (docs/releases.md).
    release_missing: frozenset[str] = frozenset()

    @property
    def budget_tokens(self) -> int | None:
        return self.budget.tokens

    @property
    def budget_usd(self) -> float | None:
        return self.budget.usd

    @property
    def budget_model_calls(self) -> int | None:
        return self.budget.model_calls

    def tool_names(self, available: tuple[str, ...], *, subagent: bool) -> tuple[str, ...]:
        """The tools this agent may call, in registry order, then the tools of its MCP servers
        that could be listed (a server that is down offers none until it is back). When
        ``tools`` names tools of a server (``travel__search``, or a pattern ``travel__*``), only
        those of that server are offered; a server it does not name offers all its tools."""
        names = list(self.registered_tool_names(available, subagent=subagent))
        if self.mcp_servers:
            from harness.tools.mcp import server_tool_names

            for server in self.mcp_servers:
                allowed = self.mcp_allow_list(server.name)
                names.extend(
                    n
                    for n in server_tool_names(server)
                    if n not in self.deny and (allowed is None or any(fnmatch.fnmatchcase(n, p) for p in allowed))
                )
        return tuple(names)

    def registered_tool_names(self, available: tuple[str, ...], *, subagent: bool) -> tuple[str, ...]:
        """The tools of ``available`` (registered ones, not MCP) this agent may call, in order."""
        names = [n for n in available if (self.tools is None or n in self.tools) and n not in self.deny]
        return tuple(n for n in names if not (subagent and n in DELEGATION_TOOLS))

    def mcp_allow_list(self, server: str) -> tuple[str, ...] | None:
        """The names and patterns of ``tools`` that name tools of ``server``; None when it names none."""
        prefix = f"{server}__"
        listed = tuple(n for n in self.tools or () if n.startswith(prefix))
        return listed or None


def parse_agents(text: str, source: str = "agents") -> dict[str, AgentDef]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AgentConfigError(f"{source}: not valid TOML: {exc}") from None
    unknown_top = set(data) - {"agents"}
    if unknown_top:
        raise AgentConfigError(f"{source}: unknown top-level keys {sorted(unknown_top)}; expected [agents.NAME]")
    tables = data.get("agents")
    if not isinstance(tables, dict) or not tables:
        raise AgentConfigError(f"{source}: no [agents.NAME] table")
    out: dict[str, AgentDef] = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise AgentConfigError(f"{source}: agents.{name} must be a table")
        extra = set(table) - _KEYS
        if extra:
            raise AgentConfigError(f"{source}: agents.{name} has unknown keys {sorted(extra)}")
        prompt = table.get("system_prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise AgentConfigError(f"{source}: agents.{name}.system_prompt is required")
        tools = table.get("tools")
        deny = table.get("deny", [])
        for key, value in (("tools", tools), ("deny", deny)):
            if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
                raise AgentConfigError(f"{source}: agents.{name}.{key} must be a list of tool names")
        approve = table.get("approve", [])
        if not isinstance(approve, list) or not all(isinstance(v, str) and v for v in approve):
            raise AgentConfigError(f"{source}: agents.{name}.approve must be a list of tool names or globs")
        approve_destructive = table.get("approve_destructive", False)
        if not isinstance(approve_destructive, bool):
            raise AgentConfigError(f"{source}: agents.{name}.approve_destructive must be true or false")
        approval_timeouts = _approval_timeouts(f"{source}: agents.{name}", table.get("approval_timeout_seconds", {}))
        on_incomplete = table.get("on_incomplete", "wait_for_user")
        if on_incomplete not in ON_INCOMPLETE:
            raise AgentConfigError(f"{source}: agents.{name}.on_incomplete must be wait_for_user or fail")
        on_budget_exhausted = table.get("on_budget_exhausted", "stop")
        if on_budget_exhausted not in ON_BUDGET_EXHAUSTED:
            raise AgentConfigError(f"{source}: agents.{name}.on_budget_exhausted must be stop or ask")
        max_rounds = table.get("max_rounds", 20)
        if not isinstance(max_rounds, int) or max_rounds < 1:
            raise AgentConfigError(f"{source}: agents.{name}.max_rounds must be a positive integer")
        mode = table.get("execution_mode", "CLOUD")
        try:
            execution_mode = ExecutionMode(mode)
        except ValueError:
            raise AgentConfigError(f"{source}: agents.{name}.execution_mode must be CLOUD or LOCAL") from None
        out[name] = AgentDef(
            name=name,
            system_prompt=prompt,
            tools=tuple(tools) if tools is not None else None,
            deny=tuple(deny),
            max_rounds=max_rounds,
            execution_mode=execution_mode,
            model_options=_model_options(f"{source}: agents.{name}", table),
            mcp_servers=_mcp_servers(f"{source}: agents.{name}", table.get("mcp_servers", [])),
            approve=tuple(approve),
            approve_destructive=approve_destructive,
            approval_timeouts=approval_timeouts,
            on_incomplete=on_incomplete,
            budget=_budget(f"{source}: agents.{name}", table.get("budget")),
            child_budget_tokens=_child_budget(f"{source}: agents.{name}", table.get("child_budget")),
            on_budget_exhausted=on_budget_exhausted,
        )
    _check_mcp_names(source, out)
    return out


def _approval_timeouts(at: str, table: Any) -> tuple[tuple[str, float], ...]:
    """``approval_timeout_seconds = { refund_order = 3600, "travel__*" = 600 }``: per tool name
    or glob, in the file's order."""
    if not isinstance(table, dict) or not all(
        isinstance(k, str) and k and isinstance(v, int | float) and not isinstance(v, bool) and v > 0
        for k, v in table.items()
    ):
        raise AgentConfigError(
            f"{at}.approval_timeout_seconds must be a table of tool names or globs to seconds > 0"
            " (approval_timeout_seconds = { refund_order = 3600 })"
        )
    return tuple((k, float(v)) for k, v in table.items())


#: The kinds a ``budget`` table may name.
BUDGET_KINDS = ("tokens", "usd", "model_calls")


def _budget(at: str, budget: Any) -> BudgetLimits:
    """``budget = { tokens = N, usd = X, model_calls = M }`` (at least one): the budget of a
    tree rooted at the agent."""
    if budget is None:
        return BudgetLimits()
    if not isinstance(budget, dict) or not budget or not set(budget) <= set(BUDGET_KINDS):
        raise AgentConfigError(f"{at}.budget must be a table {{ tokens = N, usd = X, model_calls = M }} (any of them)")
    for kind in ("tokens", "model_calls"):
        n = budget.get(kind)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise AgentConfigError(f"{at}.budget.{kind} must be a positive integer")
    dollars = budget.get("usd")
    if dollars is not None and (isinstance(dollars, bool) or not isinstance(dollars, int | float) or dollars <= 0):
        raise AgentConfigError(f"{at}.budget.usd must be a number above 0")
    return BudgetLimits(budget.get("tokens"), None if dollars is None else float(dollars), budget.get("model_calls"))


def _child_budget(at: str, cap: Any) -> int | None:
    """``child_budget = { tokens = N }``: what one child of the agent may draw."""
    if cap is None:
        return None
    tokens = cap.get("tokens") if isinstance(cap, dict) else None
    if not isinstance(cap, dict) or set(cap) != {"tokens"}:
        raise AgentConfigError(f"{at}.child_budget must be a table {{ tokens = N }}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise AgentConfigError(f"{at}.child_budget.tokens must be a positive integer")
    return tokens


def _model_options(at: str, table: dict[str, Any]) -> ModelOptions:
    model = table.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise AgentConfigError(f"{at}.model must be a non-empty string")
    temperature = table.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature <= 2
    ):
        raise AgentConfigError(f"{at}.temperature must be a number between 0 and 2")
    limits: dict[str, int | None] = {}
    for key in ("max_tokens", "max_completion_tokens"):
        value = table.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise AgentConfigError(f"{at}.{key} must be a positive integer")
        limits[key] = value
    return ModelOptions(
        model=model,
        temperature=float(temperature) if temperature is not None else None,
        max_tokens=limits["max_tokens"],
        max_completion_tokens=limits["max_completion_tokens"],
    )


def _mcp_servers(at: str, raw: Any) -> tuple[McpServer, ...]:
    if not isinstance(raw, list):
        raise AgentConfigError(f"{at}.mcp_servers must be a list of {{name, url}} tables")
    servers: list[McpServer] = []
    for position, entry in enumerate(raw):
        where = f"{at}.mcp_servers[{position}]"
        if not isinstance(entry, dict):
            raise AgentConfigError(f"{where} must be a table with name and url")
        extra = set(entry) - _MCP_KEYS
        if extra:
            raise AgentConfigError(f"{where} has unknown keys {sorted(extra)}")
        name, url, command = entry.get("name"), entry.get("url"), entry.get("command")
        if not isinstance(name, str) or not _MCP_NAME.match(name):
            raise AgentConfigError(f"{where}.name must be letters, digits, '-' and single '_'")
        if (url is None) == (command is None):
            raise AgentConfigError(f"{where} needs exactly one of url (streamable HTTP) and command (stdio)")
        if url is not None:
            parts = urlsplit(url) if isinstance(url, str) else None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise AgentConfigError(f"{where}.url must be an http:// or https:// URL")
            for key in ("args", "env", "cwd"):
                if key in entry:
                    raise AgentConfigError(f"{where}.{key} is for a stdio server (command), not a url")
        else:
            if not isinstance(command, str) or not command.strip():
                raise AgentConfigError(f"{where}.command must be a non-empty string")
            if "headers" in entry:
                raise AgentConfigError(f"{where}.headers is for an HTTP server (url), not a command")
        args = entry.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise AgentConfigError(f"{where}.args must be a list of strings")
        env = _string_table(where, "env", entry.get("env", {}))
        headers = _string_table(where, "headers", entry.get("headers", {}))
        cwd = entry.get("cwd")
        if cwd is not None and (not isinstance(cwd, str) or not cwd):
            raise AgentConfigError(f"{where}.cwd must be a non-empty string")
        trust = entry.get("trust_annotations", False)
        if not isinstance(trust, bool):
            raise AgentConfigError(f"{where}.trust_annotations must be true or false")
        timeout = entry.get("timeout_seconds", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise AgentConfigError(f"{where}.timeout_seconds must be a number > 0")
        connect_timeout = entry.get("connect_timeout_seconds", 10.0)
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, int | float) or connect_timeout <= 0:
            raise AgentConfigError(f"{where}.connect_timeout_seconds must be a number > 0")
        if any(s.name == name for s in servers):
            raise AgentConfigError(f"{where}: MCP server {name!r} is listed twice")
        servers.append(
            McpServer(
                name=name,
                url=str(url or ""),
                timeout_seconds=float(timeout),
                connect_timeout_seconds=float(connect_timeout),
                command=str(command or ""),
                args=tuple(args),
                env=env,
                cwd=cwd,
                headers=headers,
                trust_annotations=trust,
            )
        )
    return tuple(servers)


def _string_table(where: str, key: str, raw: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise AgentConfigError(f"{where}.{key} must be a table of strings")
    return tuple(sorted(raw.items()))


def _check_mcp_names(source: str, agents: dict[str, AgentDef]) -> None:
    """One MCP server name means one server (URL or command, and its settings) in the whole
    file: a tool name ``<server>__<tool>`` must say which server runs it, and how far its
    annotations are trusted, whichever agent called it."""
    seen: dict[str, tuple[str, McpServer]] = {}
    for agent in agents.values():
        for server in agent.mcp_servers:
            first = seen.setdefault(server.name, (agent.name, server))
            if first[1] != server:
                what = "two URLs" if first[1].url != server.url else "two configurations"
                raise AgentConfigError(
                    f"{source}: MCP server {server.name!r} has {what} (agents {first[0]} and {agent.name})"
                )


def _check_approve(agent: AgentDef, registered: tuple[str, ...]) -> None:
    """Refuse an ``approve`` entry that can match no tool the agent may call: it guards nothing,
    and the operator who wrote it believes some call waits for a human (a typo, a tool the
    agent's ``tools`` or ``deny`` leaves out, a tool of another agent's server). The tools it may
    call are its registered ones as a parent (the delegations included) and those of its MCP
    servers, which are known only once listed: an entry naming ``<server>__...`` for one of its
    servers, or a pattern without a server part when it has servers, may match them.
    Raises AgentConfigError."""
    from harness.tools.registry import MCP_SEPARATOR

    offered = agent.registered_tool_names(registered, subagent=False)  # servers are not listed at start
    for entry in agent.approve:
        if any(fnmatch.fnmatchcase(name, entry) for name in offered):
            continue
        server, sep, _ = entry.partition(MCP_SEPARATOR)
        if sep and any(fnmatch.fnmatchcase(s.name, server) for s in agent.mcp_servers):
            continue
        if not sep and agent.mcp_servers and any(c in entry for c in "*?["):
            continue
        raise AgentConfigError(
            f"agent {agent.name!r}: approve entry {entry!r} matches no tool this agent may call "
            f"(its tools: {', '.join(offered) or 'none'}"
            + (f"; its MCP servers: {', '.join(s.name for s in agent.mcp_servers)}" if agent.mcp_servers else "")
            + "). A rule that matches nothing guards nothing: correct the name or remove the entry"
        )


@lru_cache(maxsize=4)
def _load(path: str) -> dict[str, AgentDef]:
    if not path:
        return parse_agents(DEFAULT_AGENTS_TOML, "built-in agents")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise AgentConfigError(f"AGENTS_FILE {path!r} cannot be read: {exc.strerror}") from None
    return parse_agents(text, f"AGENTS_FILE {path}")


def load_agents() -> dict[str, AgentDef]:
    return _load(get_settings().AGENTS_FILE)


def get_agent(name: str) -> AgentDef:
    agents = load_agents()
    try:
        return agents[name]
    except KeyError:
        raise UnknownAgent(f"unknown agent {name!r}; known: {', '.join(sorted(agents))}") from None


def load_at_start() -> dict[str, AgentDef]:
    """What every process (worker, beat, CLI, demo) calls at start: import the tool modules
    (TOOL_MODULES, entry points), read the agents, and check that every tool an agent lists
    exists. Raises AgentConfigError naming the agent, the tool and the module(s) otherwise."""
    from harness.tools import REGISTRY, ToolDefinitionError, load_tool_modules
    from harness.tools.mcp import configure
    from harness.tools.registry import MCP_SEPARATOR

    agents = load_agents()
    try:
        modules = load_tool_modules()
    except ToolDefinitionError as exc:
        users = sorted(a.name for a in agents.values() if a.tools is not None and exc.tool in a.tools)
        listed = f" (listed by agent {', '.join(users)})" if users else ""
        raise AgentConfigError(f"{exc}{listed}") from None
    where = f"modules loaded: {', '.join(modules)}" if modules else "no tool module loaded (TOOL_MODULES is empty)"
    for agent in agents.values():
        servers = {s.name for s in agent.mcp_servers}
        for name in (*(agent.tools or ()), *(n for n in agent.deny if MCP_SEPARATOR not in n)):
            if MCP_SEPARATOR in name and name.split(MCP_SEPARATOR, 1)[0] in servers:
                continue  # a tool (or pattern) of one of its MCP servers: known when it is listed
            if name not in REGISTRY:
                raise AgentConfigError(
                    f"agent {agent.name!r} lists tool {name!r}, which no tool module defines ({where}; "
                    "built-ins: delegate, delegate_followup, echo, wait)"
                )
    for agent in agents.values():
        _check_approve(agent, tuple(REGISTRY))
    for agent in agents.values():
        for server in agent.mcp_servers:
            missing = sorted(v for v in server.references() if v not in os.environ)
            if missing:
                raise AgentConfigError(
                    f"agent {agent.name!r}: MCP server {server.name!r} reads environment variable(s) "
                    f"{', '.join(missing)}, which are not set"
                )
    configure([s for a in agents.values() for s in a.mcp_servers])
    return agents
