"""A tool whose JSON schema cannot be built (a parameter type pydantic has no schema for)."""

from __future__ import annotations

import threading

from harness.tools import tool


@tool
def hold_lock(lock: threading.Lock) -> str:
    """Cannot be described to a model."""
    return "held"
