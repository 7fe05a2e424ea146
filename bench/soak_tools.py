"""Tools the soak's children call: rounds with Python tools of both kinds (repeatable or not).

``charge`` is neither read-only nor idempotent: it appends its call's idempotency key to the
file named by ``SOAK_TOOL_LOG`` before it returns, as a payment service would record a charge.
The soak reads that file after every trial: a key written twice is a side effect repeated by a
recovery, which the round journal must never do. ``stamp`` is idempotent: a recovery may run it
again with the same key.
"""

from __future__ import annotations

import os
import time

from harness.tools import ToolContext, tool


@tool
def charge(ctx: ToolContext, amount_cents: int) -> str:
    """Charge an amount once (not safe to repeat)."""
    path = os.environ.get("SOAK_TOOL_LOG", "")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{ctx.idempotency_key}\n")
            fh.flush()
            os.fsync(fh.fileno())
    time.sleep(0.2)  # a window for the soak's faults between the side effect and its result
    return f"charged {amount_cents} cents"


@tool(idempotent=True)
def stamp(ctx: ToolContext, text: str) -> str:
    """Stamp a text with the call's idempotency key (safe to repeat)."""
    return f"{text} [{ctx.idempotency_key[:12]}]"
