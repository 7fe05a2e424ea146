"""Which calls wait for a human decision: ``@tool(requires_approval=True)``, the agent's
``approve`` globs, and ``approve_destructive`` over MCP annotations (which only ever add the
need); AGENTS_FILE validation of the two keys."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.agents import AgentDef, parse_agents
from harness.approval import needs_approval, refuse_beside_delegation
from harness.errors import AgentConfigError
from harness.model import ModelReply, ToolCall
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


def test_a_call_needing_approval_beside_a_delegation_is_refused_with_a_reason(tools: None) -> None:
    reply = ModelReply(None, (ToolCall("c1", "delegate", "{}"), ToolCall("c2", "refund_order", "{}")), 0, 0)
    refused = refuse_beside_delegation(agent(), reply)
    assert list(refused) == ["c2"] and "needs a human approval" in refused["c2"]


@pytest.mark.parametrize(
    ("line", "message"),
    [('approve = "refund"', "approve must be a list"), ('approve_destructive = "yes"', "true or false")],
)
def test_agents_file_rejects_a_malformed_approve_setting(line: str, message: str) -> None:
    with pytest.raises(AgentConfigError, match=message):
        parse_agents(f'[agents.a]\nsystem_prompt = "p"\n{line}\n')
