"""The tool room (docs/architecture.md).

For tool authors, the public face is three names: ``from harness.tools import tool, ToolContext,
ToolError`` (the decorator, what a running call may know, the error whose message the model
reads), and ``harness.tools.testing.ToolTester`` to test a tool's crash contract in a plain
pytest. Every other name here is internal to the loops and may change between releases.

- ``registry``: the ``@tool`` decorator, the registry, schemas from type hints, ``run_inline``.
- ``context``: ``ToolContext`` (session, call id, deadline, cancellation, idempotency key).
- ``builtins``: ``delegate`` / ``delegate_followup`` (specs only), ``echo``, ``wait``.
- ``loading``: user modules (``TOOL_MODULES``, entry point group ``agent_recovery.tools``).
- ``mcp``: tools of MCP servers (streamable HTTP or stdio) an agent lists.
- ``testing``: ``ToolTester``, the kit for tool authors.
"""

from __future__ import annotations

from harness.errors import ToolError
from harness.tools import builtins as _builtins  # noqa: F401  (registers the built-ins)
from harness.tools import mcp as _mcp  # noqa: F401  (installs the MCP room in the registry; not the SDK)
from harness.tools.context import ToolContext
from harness.tools.loading import ENTRY_POINT_GROUP, ToolModuleError, load_tool_modules
from harness.tools.registry import (
    REGISTRY,
    Tool,
    ToolDefinitionError,
    arguments_of,
    build_tool,
    lookup,
    parse_arguments,
    register,
    run_inline,
    tool,
    tool_names,
    unregister,
)

#: The public face for tool authors; the names after it are internal (imported by the loops).
__all__ = ["ToolContext", "ToolError", "tool"]
__all__ += [
    "ENTRY_POINT_GROUP",
    "REGISTRY",
    "Tool",
    "ToolContext",
    "ToolDefinitionError",
    "ToolModuleError",
    "arguments_of",
    "build_tool",
    "load_tool_modules",
    "lookup",
    "parse_arguments",
    "register",
    "run_inline",
    "tool_names",
    "unregister",
]


def __getattr__(name: str) -> tuple[str, ...]:
    # TOOL_NAMES was a constant before user tools existed; it is now read at each use, so that
    # tools registered after this import (TOOL_MODULES) are in it.
    if name == "TOOL_NAMES":
        return tool_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
