"""A tool that needs approval, for processes a test starts (``TOOL_MODULES=tests.approval_tools``):
the CLI checks edited arguments against its schema; a worker runs it and appends one line per run
to the file named by ``APPROVAL_TOOL_LOG`` (the test counts the runs)."""

from __future__ import annotations

import json
import os

from harness.tools import ToolContext, tool


@tool(requires_approval=True)
def refund(ctx: ToolContext, order: str, amount: int) -> str:
    """Refund an order."""
    path = os.environ.get("APPROVAL_TOOL_LOG", "")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"session_id": ctx.session_id, "order": order, "amount": amount}) + "\n")
    return f"refunded {amount} on {order}"
