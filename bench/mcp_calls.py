"""MCP tool calls per second to a stdio server: ``python bench/mcp_calls.py [--calls N] [--threads T]``.

Runs N calls of ``time__get_current_time`` of PyPI's ``mcp-server-time`` (started as
``python -m mcp_server_time``) through ``run_inline``, as an agent's loop runs them, from T
threads at once, after one listing; prints the calls per second, and how many times the server
was started in this process (docs/mcp.md: one kept session per process and server; before it,
every call and every listing started its own server process). No database, no broker.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="tool calls in all (default 50)")
    parser.add_argument("--threads", type=int, default=1, help="threads calling at once (default 1)")
    args = parser.parse_args(argv)

    from harness.tools import ToolContext, run_inline
    from harness.tools import mcp as mcp_tools
    from harness.tools.mcp import McpServer

    server = McpServer(
        "time", command=sys.executable, args=("-m", "mcp_server_time", "--local-timezone", "UTC"), timeout_seconds=30
    )
    mcp_tools.configure([server])
    allowed = mcp_tools.server_tool_names(server)
    if "time__get_current_time" not in allowed:
        print(f"mcp-server-time could not be listed: {mcp_tools.unavailable_reason('time__x')}")
        return 1

    def one(n: int) -> bool:
        result = run_inline("time__get_current_time", '{"timezone": "UTC"}', ToolContext(1, f"c{n}", None), allowed)
        return '"timezone": "UTC"' in result

    started = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        ok = sum(pool.map(one, range(args.calls)))
    elapsed = time.perf_counter() - started
    try:
        from harness.tools.mcp_session import started as server_starts

        starts = str(server_starts("time"))
    except ImportError:  # the code before kept sessions: one server process per call and listing
        starts = f"{args.calls + 1} (one per call and listing)"
    print(f"mcp_calls calls={args.calls} threads={args.threads} ok={ok} seconds={elapsed:.2f}")
    print(f"mcp_calls calls_per_second={args.calls / elapsed:.1f} server_starts={starts}")
    mcp_tools.forget()
    return 0 if ok == args.calls else 1


if __name__ == "__main__":
    raise SystemExit(main())
