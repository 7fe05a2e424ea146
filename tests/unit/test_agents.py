"""Agent definitions: TOML tables, clear errors, no recursive delegation for subagents."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.agents import DEFAULT_AGENTS_TOML, DELEGATION_TOOLS, _load, get_agent, load_agents, parse_agents
from harness.errors import AgentConfigError, UnknownAgent
from harness.tools import TOOL_NAMES
from models import ExecutionMode
from settings import get_settings


def test_built_in_default_has_main_reviewer_researcher() -> None:
    agents = parse_agents(__import__("harness.agents", fromlist=["x"]).DEFAULT_AGENTS_TOML)
    assert set(agents) == {"main", "reviewer", "researcher"}
    assert set(DELEGATION_TOOLS) <= set(agents["main"].tool_names(TOOL_NAMES, subagent=False))


def test_a_subagent_never_gets_delegation_tools_even_if_listed() -> None:
    (agent,) = parse_agents('[agents.x]\nsystem_prompt = "p"\ntools = ["delegate", "echo"]\n').values()
    assert agent.tool_names(TOOL_NAMES, subagent=True) == ("echo",)
    assert agent.tool_names(TOOL_NAMES, subagent=False) == ("delegate", "echo")


def test_deny_and_execution_mode() -> None:
    (agent,) = parse_agents('[agents.x]\nsystem_prompt = "p"\ndeny = ["wait"]\nexecution_mode = "LOCAL"\n').values()
    assert "wait" not in agent.tool_names(TOOL_NAMES, subagent=True)
    assert agent.execution_mode == ExecutionMode.LOCAL


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[agents.x]\nsystem_prompt = "p"\ncolour = "red"\n', "unknown keys"),
        ("[agents.x]\n", "system_prompt is required"),
        ('[agents.x]\nsystem_prompt = "p"\nmax_rounds = 0\n', "max_rounds"),
        ('[agents.x]\nsystem_prompt = "p"\nexecution_mode = "MOON"\n', "CLOUD or LOCAL"),
        ('[agents.x]\nsystem_prompt = "p"\ntemperature = 3\n', "agents.x.temperature must be a number between 0 and 2"),
        ('[agents.x]\nsystem_prompt = "p"\nmax_tokens = 0\n', "agents.x.max_tokens must be a positive integer"),
        ('[agents.x]\nsystem_prompt = "p"\nmodel = ""\n', "agents.x.model must be a non-empty string"),
        ('[agents.x]\nsystem_prompt = "p"\nmcp_servers = [{name = "a", url = "ftp://h"}]\n', "url must be an http"),
        ('[agents.x]\nsystem_prompt = "p"\nmcp_servers = [{name = "a__b", url = "http://h"}]\n', ".name must be"),
        (
            '[agents.x]\nsystem_prompt = "p"\nmcp_servers = [{name = "a", url = "http://h/1"}]\n'
            '[agents.y]\nsystem_prompt = "p"\nmcp_servers = [{name = "a", url = "http://h/2"}]\n',
            "MCP server 'a' has two URLs",
        ),
        ('[agents.x]\nsystem_prompt = "p"\ntools = "echo"\n', "list of tool names"),
        ("[other]\nx = 1\n", "unknown top-level"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_invalid_definitions_are_clear_errors(text: str, message: str) -> None:
    with pytest.raises(AgentConfigError, match=message):
        parse_agents(text)


def test_agents_file_and_unknown_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "agents.toml"
    path.write_text('[agents.solo]\nsystem_prompt = "alone"\n')
    monkeypatch.setenv("AGENTS_FILE", str(path))
    get_settings.cache_clear()
    _load.cache_clear()
    try:
        assert set(load_agents()) == {"solo"}
        with pytest.raises(UnknownAgent, match="known: solo"):
            get_agent("main")
        monkeypatch.setenv("AGENTS_FILE", str(tmp_path / "missing.toml"))
        get_settings.cache_clear()
        with pytest.raises(AgentConfigError, match="cannot be read"):
            load_agents()
    finally:
        get_settings.cache_clear()
        _load.cache_clear()


def test_the_built_in_main_agent_lists_its_tools_and_is_not_offered_a_tool_module_loaded_later() -> None:
    agents = parse_agents(DEFAULT_AGENTS_TOML, "built-in")
    main = agents["main"]
    assert main.tools == ("delegate", "delegate_followup", "echo", "wait")
    assert main.tool_names((*TOOL_NAMES, "refund_order"), subagent=False) == (
        "delegate",
        "delegate_followup",
        "echo",
        "wait",
    )


def test_on_incomplete_is_wait_for_user_by_default_and_only_fail_or_wait_for_user() -> None:
    from harness.agents import parse_agents as parse

    base = '[agents.a]\nsystem_prompt = "p"\n'
    assert parse(base)["a"].on_incomplete == "wait_for_user"
    assert parse(base + 'on_incomplete = "fail"\n')["a"].on_incomplete == "fail"
    with pytest.raises(AgentConfigError, match="on_incomplete"):
        parse(base + 'on_incomplete = "retry"\n')
