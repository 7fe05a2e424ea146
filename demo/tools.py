"""The demo's tool that needs a human yes (``python -m demo approval``): ``refund`` appends one
line per run to ``$DEMO_DIR/refunds.log``, so the demo can show it ran exactly once."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.tools import ToolContext, tool


@tool(requires_approval=True)
def refund(ctx: ToolContext, order: str, amount: int) -> str:
    """Refund an order (money leaves the company: a human approves every call)."""
    log = Path(os.environ.get("DEMO_DIR", "demo-data")) / "refunds.log"
    with log.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps({"order": order, "amount": amount, "key": ctx.idempotency_key}) + "\n")
    return f"refunded {amount} EUR on order {order}"
