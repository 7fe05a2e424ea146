"""A tool that is not safe to repeat: ``charge`` takes money (neither read-only nor idempotent).
Each real run appends one line to the file named by ``CHARGE_TOOL_LOG`` (with the process id), so
a test counts how often it ran and in which process."""

from __future__ import annotations

import json
import os

from harness.tools import ToolContext, tool


@tool
def charge(ctx: ToolContext, order: str, amount: int) -> str:
    """Charge the customer of an order (money moves: not safe to run twice)."""
    path = os.environ.get("CHARGE_TOOL_LOG", "")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"session_id": ctx.session_id, "order": order, "amount": amount, "pid": os.getpid()}))
            fh.write("\n")
    return f"charged {amount} on {order}"
