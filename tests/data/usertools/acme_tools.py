"""A user's tools module that lives outside the product packages (issue 17 item 1): the tests
put this folder on PYTHONPATH and name the module in TOOL_MODULES."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from harness.tools import ToolContext, tool


@tool(read_only=True)
def lookup_order(order_id: Annotated[int, Field(ge=1)]) -> dict[str, object]:
    """Look an order up by its id."""
    return {"order_id": order_id, "status": "shipped"}


@tool(name="refund_order", idempotent=True)
def refund(ctx: ToolContext, order_id: int, amount_cents: int) -> str:
    """Refund part of an order. The payment service deduplicates on the idempotency key."""
    return f"refunded {amount_cents} cents on order {order_id} with key {ctx.idempotency_key}"


@tool
def check_inventory(sku: str) -> str:
    """Ask the inventory service how many items of a SKU are left."""
    raise ConnectionRefusedError(f"inventory service refused the request for {sku}")
