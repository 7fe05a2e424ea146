"""A tool that is not safe to repeat and says when it runs: it touches the file named by
TOOL_STARTED_FILE once it has started, then holds for the given seconds (the tests that stop a
worker while a tool runs wait for the file, not for a sleep); and one that never ends."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

from pydantic import Field

from harness.tools import tool


@tool
def charge_slowly(seconds: Annotated[float, Field(ge=0, le=600)]) -> str:
    """Charge the card, taking the given number of seconds (not safe to repeat)."""
    Path(os.environ["TOOL_STARTED_FILE"]).write_text(str(os.getpid()), encoding="utf-8")
    time.sleep(seconds)
    return f"charged after {seconds:g} seconds"


@tool(timeout_seconds=0.3)
def never_ends() -> str:
    """A call that never ends (its thread is left stuck when the call times out)."""
    while True:
        time.sleep(60)
