"""The tools of deploy v1, for worker processes a test starts (``TOOL_MODULES=tests.release_tools_v1``):
``lookup_order`` (renamed ``find_order`` in v2) and ``wire`` (which v2 makes need approval). Each run
appends one line to the file named by ``RELEASE_TOOL_LOG`` (the test counts the runs)."""

from __future__ import annotations

import json
import os

from harness.tools import ToolContext, tool


def logged(name: str, ctx: ToolContext, **arguments: object) -> None:
    path = os.environ.get("RELEASE_TOOL_LOG", "")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"tool": name, "session_id": ctx.session_id, **arguments}) + "\n")


@tool
def lookup_order(ctx: ToolContext, order: str) -> str:
    """Look an order up."""
    logged("lookup_order", ctx, order=order)
    return f"found {order}"


@tool
def wire(ctx: ToolContext, amount: int) -> str:
    """Wire money."""
    logged("wire", ctx, amount=amount)
    return f"wired {amount}"
