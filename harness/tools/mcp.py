"""Tools of MCP servers (placeholder until item 4 lands)."""

from __future__ import annotations

from harness.tools.registry import Tool


def lookup_mcp_tool(name: str) -> Tool | None:
    return None


def unavailable_reason(name: str) -> str:
    return ""


def configure(servers: object) -> None:
    return None


def server_tool_names(server: object) -> tuple[str, ...]:
    return ()
