"""Which calls wait for a human decision: ``@tool(requires_approval=True)``, the agent's
``approve`` globs, and ``approve_destructive`` over MCP annotations (which only ever add the
need); AGENTS_FILE validation of the two keys, and the start refusing an ``approve`` entry that
can match no tool the agent may call."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.agents import AgentDef, parse_agents
from harness.approval import needs_approval
from harness.errors import AgentConfigError
from harness.tools import ToolContext, tool, unregister
from harness.tools.registry import Tool


def agent(**kw: object) -> AgentDef:
    text = '[agents.a]\nsystem_prompt = "p"\n' + "".join(f"{k} = {v}\n" for k, v in kw.items())
    return parse_agents(text)["a"]


@pytest.fixture
def tools(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    @tool(requires_approval=True)
    def refund_order(ctx: ToolContext, order: str) -> str:
        """Refund."""
        return order

    @tool
    def lookup_order(order: str) -> str:
        """Look up."""
        return order

    mcp = {
        "files__delete": Tool("files__delete", "", {}, None, destructive=True),
        "files__touch": Tool("files__touch", "", {}, None, destructive=None),  # hint absent
        "files__read": Tool("files__read", "", {}, None, read_only=True, destructive=False),
    }
    import harness.tools.mcp

    monkeypatch.setattr(harness.tools.mcp, "lookup_mcp_tool", mcp.get)
    yield
    unregister("refund_order")
    unregister("lookup_order")


def test_a_tool_declared_requires_approval_needs_it_for_every_agent(tools: None) -> None:
    assert needs_approval(agent(), "refund_order")
    assert not needs_approval(agent(), "lookup_order")


def test_an_agents_approve_globs_add_the_need_to_tools_it_did_not_write(tools: None) -> None:
    a = agent(approve='["lookup_*", "travel__book*"]')
    assert needs_approval(a, "lookup_order")
    assert needs_approval(a, "travel__book_flight")
    assert not needs_approval(a, "travel__search")
    assert needs_approval(a, "refund_order")  # configuration never removes a declared need


def test_approve_destructive_covers_mcp_tools_whose_destructive_hint_is_true_or_absent(tools: None) -> None:
    a = agent(approve_destructive="true")
    assert needs_approval(a, "files__delete")
    assert needs_approval(a, "files__touch")
    assert not needs_approval(a, "files__read")
    assert not needs_approval(agent(), "files__delete")  # off by default
    assert needs_approval(agent(approve='["files__read"]'), "files__read")  # annotations only tighten


@pytest.mark.parametrize(
    ("line", "message"),
    [('approve = "refund"', "approve must be a list"), ('approve_destructive = "yes"', "true or false")],
)
def test_agents_file_rejects_a_malformed_approve_setting(line: str, message: str) -> None:
    with pytest.raises(AgentConfigError, match=message):
        parse_agents(f'[agents.a]\nsystem_prompt = "p"\n{line}\n')


def start_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: str) -> dict[str, AgentDef]:
    """``load_at_start`` (what every worker, beat and CLI runs first) over one agent ``a``."""
    from harness.agents import _load, load_at_start
    from harness.tools import mcp
    from settings import get_settings

    path = tmp_path / "agents.toml"
    path.write_text(f'[agents.a]\nsystem_prompt = "p"\n{table}\n', encoding="utf-8")
    monkeypatch.setenv("AGENTS_FILE", str(path))
    monkeypatch.setenv("TOOL_MODULES", "")
    get_settings.cache_clear()
    _load.cache_clear()
    try:
        return load_at_start()
    finally:
        get_settings.cache_clear()
        _load.cache_clear()
        mcp.forget()


TRAVEL = 'mcp_servers = [{name = "travel", url = "http://127.0.0.1:9/mcp"}]'


@pytest.mark.parametrize(
    ("table", "entry"),
    [
        ('approve = ["refund_ordr"]', "refund_ordr"),  # a typo: the tool meant runs unguarded
        ('tools = ["echo", "wait"]\napprove = ["delegate"]', "delegate"),  # a tool the agent is not offered
        ('deny = ["echo"]\napprove = ["ech*"]', "ech*"),  # a tool its deny list removes
        (f'{TRAVEL}\napprove = ["files__delete"]', "files__delete"),  # a server of another agent
    ],
    ids=["no_such_tool", "not_offered", "denied", "another_server"],
)
def test_an_approve_rule_that_matches_no_tool_the_agent_may_call_stops_the_start_with_a_clear_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: str, entry: str
) -> None:
    with pytest.raises(AgentConfigError) as info:
        start_with(tmp_path, monkeypatch, table)
    message = str(info.value)
    assert f"agent 'a': approve entry {entry!r} matches no tool this agent may call" in message
    assert "guards nothing" in message


@pytest.mark.parametrize(
    "table",
    [
        'approve = ["*"]',
        'approve = ["delegate"]',
        'tools = ["delegate", "echo"]\napprove = ["delegate*", "echo"]',
        f'{TRAVEL}\napprove = ["travel__book*", "*cancel*"]',  # tools of its server, listed only later
    ],
    ids=["star", "delegate", "globs_over_built_ins", "mcp_patterns"],
)
def test_approve_rules_over_the_built_in_tools_and_the_agents_mcp_servers_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: str
) -> None:
    agents = start_with(tmp_path, monkeypatch, table)
    assert agents["a"].approve
    assert needs_approval(agents["a"], "delegate") is ("delegate" in table or '"*"' in table)


def test_a_tools_approval_callable_is_asked_with_the_arguments_and_fails_closed_when_it_raises() -> None:
    from harness.tools.testing import ToolTester

    def above_100(arguments: dict[str, object]) -> bool:
        return int(str(arguments["amount"])) > 100

    @tool(requires_approval=above_100)
    def refund_part(order: str, amount: int) -> str:
        """Refund part."""
        return order

    try:
        tester = ToolTester(refund_part)
        assert tester.needs_approval
        assert not tester.needs_approval_for(order="A", amount=100)
        assert tester.needs_approval_for(order="A", amount=101)
        assert tester.needs_approval_for(order="A")  # the callable raises KeyError: a person decides
    finally:
        unregister("refund_part")


def test_requires_approval_and_approval_timeout_seconds_are_checked_at_the_decorator() -> None:
    from harness.tools.registry import ToolDefinitionError

    with pytest.raises(ToolDefinitionError, match="approval_timeout_seconds must be > 0"):

        @tool(requires_approval=True, approval_timeout_seconds=0)
        def never(order: str) -> str:
            """Never."""
            return order

    with pytest.raises(ToolDefinitionError, match="requires_approval must be true, false or a callable"):

        @tool(requires_approval="yes")  # type: ignore[arg-type]
        def never_either(order: str) -> str:
            """Never."""
            return order


@pytest.mark.parametrize(
    "value", ["600", "{ refund_order = 0 }", '{ refund_order = "1h" }', "{ refund_order = true }", '{ "" = 5 }']
)
def test_an_agents_approval_timeout_seconds_must_be_tool_names_to_positive_seconds(value: str) -> None:
    with pytest.raises(AgentConfigError, match="approval_timeout_seconds must be a table of tool names or globs"):
        agent(approval_timeout_seconds=value)
    assert agent(approval_timeout_seconds='{ refund_order = 60, "travel__*" = 1.5 }').approval_timeouts == (
        ("refund_order", 60.0),
        ("travel__*", 1.5),
    )
