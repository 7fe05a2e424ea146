"""A long tool that is safe to repeat (issue 15 item 2 with the round journal of issue 17): a
child recovered in the middle of ``hold`` runs it again (idempotent), so it stays busy for the
whole wait after its recovery, as an hour-long child would. ``wait`` is neither read-only nor
idempotent: a recovered child would be told its wait was interrupted and end at once."""

from __future__ import annotations

import time
from typing import Annotated

from pydantic import Field

from harness.errors import Cancelled
from harness.tools import ToolContext, tool


@tool(idempotent=True)
def hold(ctx: ToolContext, seconds: Annotated[float, Field(ge=0, le=3600)]) -> str:
    """Hold for the given number of seconds (safe to run again after a crash)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if ctx.cancelled():
            raise Cancelled("cancelled while holding")
        time.sleep(min(0.1, left))
    return f"held {seconds:g} seconds"
