"""The built-in tools: ``delegate`` and ``delegate_followup`` (specs only: the loop turns their
calls into child executions, docs/tasks.md), and ``echo`` and ``wait``, ordinary tools."""

from __future__ import annotations

import time
from typing import Annotated

from pydantic import Field

from crashpoints import crash_point
from harness.errors import Cancelled, DeadlineExceeded
from harness.tools.context import ToolContext
from harness.tools.registry import Tool, register, tool

_OBJ = "object"

register(
    Tool(
        "delegate",
        "Run a subagent of the given type on a task in a new child session; returns its result.",
        {
            "type": _OBJ,
            "properties": {"agent_type": {"type": "string"}, "task": {"type": "string"}},
            "required": ["agent_type", "task"],
        },
        None,
        module=__name__,
        qualname="delegate",
    )
)
register(
    Tool(
        "delegate_followup",
        "Send a follow-up task to an existing child session; returns the child's new result.",
        {
            "type": _OBJ,
            "properties": {"child_session_id": {"type": "integer"}, "task": {"type": "string"}},
            "required": ["child_session_id", "task"],
        },
        None,
        module=__name__,
        qualname="delegate_followup",
    )
)


@tool(read_only=True)
def echo(text: str) -> str:
    """Return the given text."""
    return text


#: How often ``wait`` looks at cancellation and the deadline.
WAIT_STEP_SECONDS = 0.1


@tool(timeout_seconds=24 * 3600 + 60)
def wait(ctx: ToolContext, seconds: Annotated[float, Field(ge=0, le=24 * 3600)] = 1) -> str:
    """Wait the given number of seconds."""
    # Sleeps in small steps, honouring cancellation and the deadline. A child's wait is where
    # the crash matrix kills a worker in the middle of a tool.
    if ctx.kind == "child":
        crash_point("child.mid_tool")
    end = time.monotonic() + float(seconds)
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return f"waited {seconds:g} seconds"
        if ctx.cancelled():
            raise Cancelled("cancelled while waiting")
        deadline_left = ctx.seconds_left()
        if deadline_left is not None and deadline_left <= 0:
            raise DeadlineExceeded("deadline reached while waiting")
        time.sleep(min(WAIT_STEP_SECONDS, left))
