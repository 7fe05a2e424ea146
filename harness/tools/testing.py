"""A testing kit for tool authors: your tool's crash contract in a plain pytest, with no database,
broker or worker.

    from harness.tools.testing import ToolTester
    from acme.tools import refund_order

    def test_a_refund_interrupted_by_a_crash_is_not_run_again_and_the_model_is_told():
        tester = ToolTester(refund_order)
        after = tester.crash_during(order_id=7, amount_cents=300)
        assert not after.ran_again
        assert "may or may not have taken effect" in after.result

It runs the tool as a worker does (arguments validated against its schema, the result capped
and redacted as the model will see it, a ``ToolError`` turned into ``error: ...``) and answers
what the loops would do when the worker dies while the call runs: a read-only or idempotent tool
runs again with the SAME ``ctx.idempotency_key`` (at most ``TOOL_MAX_RERUNS`` times); any other
tool is not run again and the model is told so, with its arguments. The rules are the loops' own
(`harness.journal`), not a copy of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from harness.callids import new_call_id
from harness.journal import interrupted_result, repeatable
from harness.model import ToolCall
from harness.tools.context import ToolContext
from harness.tools.registry import Tool, lookup, run_inline

#: The installation id the kit's keys are drawn in (a real installation draws its own, once).
TEST_INSTALLATION = "tool-tester"


@dataclass(frozen=True)
class Run:
    """One run of the tool: the TOOL result the model reads, and the call it ran for."""

    result: str
    call_id: str
    idempotency_key: str


@dataclass(frozen=True)
class AfterCrash:
    """What follows when the worker died while the call ran."""

    #: True when the recovered loop ran the call again (read-only or idempotent tools).
    ran_again: bool
    #: The TOOL result the model reads after the recovery: the re-run's result, or the
    #: "interrupted ... may or may not have taken effect" text.
    result: str
    #: The key of the interrupted run and of every re-run: the same for one call.
    idempotency_key: str


class ToolTester:
    """Runs one registered tool the way the loops do. ``tool`` is the decorated function (or its
    name); ``session_id`` is what ``ctx.session_id`` says."""

    def __init__(self, tool: Any, *, session_id: int = 1) -> None:
        name = tool if isinstance(tool, str) else getattr(tool, "__name__", "")
        found = lookup(name) or _registered_as(tool)
        if found is None or found.run is None:
            raise LookupError(f"{name!r} is not a registered tool with a function (is it decorated with @tool?)")
        self.tool: Tool = found
        self.session_id = session_id

    @property
    def repeatable(self) -> bool:
        """True when a call interrupted by a crash runs again (read-only or idempotent)."""
        return repeatable(self.tool.name)

    @property
    def needs_approval(self) -> bool:
        """True when calls wait for a person's decision before they run: every call
        (``requires_approval=True``), or those its callable picks (``needs_approval_for``)."""
        return self.tool.requires_approval or self.tool.approval_rule is not None

    def needs_approval_for(self, **arguments: Any) -> bool:
        """True when a call with these arguments waits for a person: the tool's callable decides
        as a worker asks it (a callable that raises: True)."""
        from harness.approval import rule_decision

        return self.tool.requires_approval or rule_decision(
            self.tool, json.dumps(arguments), session_id=self.session_id
        )

    def call(self, **arguments: Any) -> Run:
        """One call with these arguments, as a new call of the model (a new key)."""
        ctx = self._context(new_call_id())
        return Run(self._run(ctx, arguments), ctx.tool_call_id, ctx.idempotency_key)

    def crash_during(self, *, reruns_that_crash: int = 0, **arguments: Any) -> AfterCrash:
        """The call started, then the worker died before its result was saved; the recovered loop
        continues the round. ``reruns_that_crash`` re-runs die too (a call that kills its worker
        every time): past ``TOOL_MAX_RERUNS`` the call is reported interrupted."""
        from settings import get_settings

        ctx = self._context(new_call_id())
        self._run(ctx, arguments)  # the interrupted run: its effect may have happened
        call = ToolCall(ctx.tool_call_id, self.tool.name, json.dumps(arguments))
        if not self.repeatable or reruns_that_crash >= get_settings().TOOL_MAX_RERUNS:
            return AfterCrash(False, interrupted_result(call), ctx.idempotency_key)
        for _ in range(reruns_that_crash):
            self._run(ctx, arguments)
        return AfterCrash(True, self._run(ctx, arguments), ctx.idempotency_key)

    def _context(self, call_id: str) -> ToolContext:
        return ToolContext(self.session_id, call_id, None, namespace=TEST_INSTALLATION)

    def _run(self, ctx: ToolContext, arguments: dict[str, Any]) -> str:
        return run_inline(self.tool.name, json.dumps(arguments), ctx, (self.tool.name,))


def _registered_as(fn: Any) -> Tool | None:
    """The registered tool whose function is ``fn`` (a tool renamed with ``@tool(name=...)``)."""
    from harness.tools.registry import REGISTRY

    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    return next((t for t in REGISTRY.values() if t.qualname == qualname and t.module == module), None)
