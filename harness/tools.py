"""The tool registry. Inline tools run in the loop; delegation tools are specs only (the loop
turns their calls into child executions, DESIGN §6)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from crashpoints import crash_point
from harness.errors import Cancelled, DeadlineExceeded, ToolError
from models.base import utcnow


@dataclass
class ToolContext:
    session_id: int
    tool_call_id: str
    #: Absolute deadline (UTC) of the loop running the tool, or None.
    deadline: datetime | None
    #: True when the session was cancelled or this worker lost its lease.
    cancelled: Callable[[], bool] = field(default=lambda: False)
    #: Child loops mark tool steps with crash points under this prefix ("child" / "parent").
    kind: str = "parent"

    def seconds_left(self) -> float | None:
        if self.deadline is None:
            return None
        return (self.deadline - utcnow()).total_seconds()


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[[ToolContext, dict[str, Any]], str] | None  #: None for delegation tools

    def spec(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _echo(ctx: ToolContext, args: dict[str, Any]) -> str:
    text = args.get("text")
    if not isinstance(text, str):
        raise ToolError("echo needs a string argument 'text'")
    return text


WAIT_STEP_SECONDS = 0.1


def _wait(ctx: ToolContext, args: dict[str, Any]) -> str:
    """Sleep N seconds in small steps, honouring cancellation and the deadline."""
    seconds = args.get("seconds", 1)
    if not isinstance(seconds, int | float) or seconds < 0 or seconds > 24 * 3600:
        raise ToolError("wait needs 'seconds' between 0 and 86400")
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


_OBJ = "object"
REGISTRY: dict[str, Tool] = {
    t.name: t
    for t in (
        Tool(
            "delegate",
            "Run a subagent of the given type on a task in a new child session; returns its result.",
            {
                "type": _OBJ,
                "properties": {"agent_type": {"type": "string"}, "task": {"type": "string"}},
                "required": ["agent_type", "task"],
            },
            None,
        ),
        Tool(
            "delegate_followup",
            "Send a follow-up task to an existing child session; returns the child's new result.",
            {
                "type": _OBJ,
                "properties": {"child_session_id": {"type": "integer"}, "task": {"type": "string"}},
                "required": ["child_session_id", "task"],
            },
            None,
        ),
        Tool(
            "echo",
            "Return the given text.",
            {"type": _OBJ, "properties": {"text": {"type": "string"}}, "required": ["text"]},
            _echo,
        ),
        Tool(
            "wait",
            "Wait the given number of seconds.",
            {"type": _OBJ, "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
            _wait,
        ),
    )
}
TOOL_NAMES = tuple(REGISTRY)


def parse_arguments(raw: str) -> dict[str, Any]:
    """The JSON object of a tool call's arguments; ToolError when it is not one."""
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        raise ToolError("arguments are not valid JSON") from None
    if not isinstance(value, dict):
        raise ToolError("arguments must be a JSON object")
    return value


def run_inline(name: str, raw_arguments: str, ctx: ToolContext, allowed: tuple[str, ...]) -> str:
    """Run one inline tool; every failure becomes the TOOL result text (never raises for tool
    errors). Cancellation and deadline propagate so the loop can stop."""
    tool = REGISTRY.get(name)
    if tool is None or name not in allowed or tool.run is None:
        return f"error: tool {name!r} is not available"
    try:
        return tool.run(ctx, parse_arguments(raw_arguments))
    except ToolError as exc:
        return f"error: {exc}"
