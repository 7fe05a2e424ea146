"""The tools of deploy v2 (``TOOL_MODULES=tests.release_tools_v2``): v1's ``lookup_order``
renamed ``find_order``, and ``wire`` with the same schema that now needs approval."""

from __future__ import annotations

import json
import os

from harness.tools import ToolContext, tool


def logged(name: str, ctx: ToolContext, **arguments: object) -> None:
    """As v1's (not imported from it: importing v1's module would register v1's tools here)."""
    path = os.environ.get("RELEASE_TOOL_LOG", "")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"tool": name, "session_id": ctx.session_id, **arguments}) + "\n")


@tool
def find_order(ctx: ToolContext, order: str) -> str:
    """Find an order."""
    logged("find_order", ctx, order=order)
    return f"found {order}"


@tool(requires_approval=True)
def wire(ctx: ToolContext, amount: int) -> str:
    """Wire money."""
    logged("wire", ctx, amount=amount)
    return f"wired {amount}"
