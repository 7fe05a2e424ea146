"""Agent definitions from TOML (`AGENTS_FILE`, or the built-in default).

One table per agent: ``[agents.NAME]`` with ``system_prompt``, optional ``tools`` (allow list),
``deny``, ``max_rounds``, ``execution_mode`` (CLOUD | LOCAL). A subagent's tools never include
``delegate`` / ``delegate_followup`` (no recursive delegation, spec §5.1).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache

from harness.errors import AgentConfigError, UnknownAgent
from models import ExecutionMode
from settings import get_settings

DELEGATION_TOOLS = ("delegate", "delegate_followup")
_KEYS = {"system_prompt", "tools", "deny", "max_rounds", "execution_mode"}

DEFAULT_AGENTS_TOML = """
[agents.main]
system_prompt = "You are the main agent. Delegate work to subagents with the delegate tool and combine results."
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

    def tool_names(self, available: tuple[str, ...], *, subagent: bool) -> tuple[str, ...]:
        """The tools this agent may call, in registry order."""
        names = [n for n in available if (self.tools is None or n in self.tools) and n not in self.deny]
        if subagent:
            names = [n for n in names if n not in DELEGATION_TOOLS]
        return tuple(names)


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
        )
    return out


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
