"""Defines ``lookup_order`` a second time (acme_tools has it): loading both must stop the process."""

from __future__ import annotations

from harness.tools import tool


@tool
def lookup_order(order_id: int) -> str:
    """Another lookup_order."""
    return str(order_id)
