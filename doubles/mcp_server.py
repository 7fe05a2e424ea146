"""A real MCP server (streamable HTTP) on loopback, built with the official ``mcp`` SDK, for the
tests and the demo of MCP tools.

Tools: ``lookup_city`` (readOnlyHint), ``book_room`` (idempotentHint), ``charge_card`` (no
hint: neither) and ``always_fails`` (raises: an ``isError`` result); with ``extras=True`` also
``slow_charge``, ``whoami`` and ``réserver`` (``_add_extras``). ``calls`` records each
call's tool name and arguments; ``keys`` the idempotency key each ``book_room`` call carried in
its ``_meta`` (harness.tools.mcp.IDEMPOTENCY_META_KEY).

In-process: ``with McpTestServer() as server: server.url``. Standalone:
``python -m doubles.mcp_server --port N`` (prints the listening line).
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

#: Path of the streamable-HTTP endpoint.
MCP_PATH = "/mcp"


def build_server(
    calls: list[tuple[str, dict[str, Any]]], keys: list[str | None] | None = None, *, extras: bool = False
) -> Any:
    server: Any = MCPServer("acme-travel")
    if extras:
        _add_extras(server, calls)

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def lookup_city(name: str) -> str:
        """Facts about a city."""
        calls.append(("lookup_city", {"name": name}))
        return f"{name}: 3 hotels"

    @server.tool(annotations=ToolAnnotations(idempotent_hint=True))
    def book_room(city: str, nights: int, ctx: Context) -> str:
        """Book a room (idempotent: the same booking twice is one booking)."""
        calls.append(("book_room", {"city": city, "nights": nights}))
        meta = ctx.request_context.meta or {}
        if keys is not None:
            keys.append(meta.get("io.agent-recovery/idempotency-key"))  # type: ignore[union-attr]
        return f"booked {nights} nights in {city}"

    @server.tool()
    def charge_card(amount_cents: int) -> str:
        """Charge the card on file."""
        calls.append(("charge_card", {"amount_cents": amount_cents}))
        return f"charged {amount_cents}"

    @server.tool()
    def always_fails() -> str:
        """A tool whose service is broken."""
        calls.append(("always_fails", {}))
        raise RuntimeError("the booking backend is down")

    return server


def _add_extras(server: Any, calls: list[tuple[str, dict[str, Any]]]) -> None:
    """Tools only some tests want: ``slow_charge`` (sleeps before it answers; no hint),
    ``whoami`` (the Authorization header the request carried) and ``réserver`` (a name no
    provider accepts as a function name)."""

    @server.tool()
    def slow_charge(amount_cents: int, seconds: float) -> str:
        """Charge the card, slowly."""
        calls.append(("slow_charge", {"amount_cents": amount_cents}))
        time.sleep(seconds)
        return f"charged {amount_cents}"

    @server.tool()
    def whoami(ctx: Context) -> str:
        """The Authorization header of the request."""
        request = ctx.request_context.request
        return str(request.headers.get("authorization", "")) if request is not None else ""

    @server.tool(name="réserver")
    def reserver() -> str:
        """A tool whose name is not ASCII."""
        return "reserved"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class McpTestServer:
    """The server on a uvicorn thread; ``start()`` returns its URL once it accepts connections."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, extras: bool = False) -> None:
        self.host = host
        self.extras = extras
        self.port = port or _free_port()
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.keys: list[str | None] = []
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{MCP_PATH}"

    def start(self, timeout: float = 15.0) -> str:
        import uvicorn

        server = build_server(self.calls, self.keys, extras=self.extras)
        app = server.streamable_http_app(streamable_http_path=MCP_PATH, host=self.host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", lifespan="on")
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, name="mcp-test-server", daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout
        while not self._uvicorn.started:
            if time.monotonic() > end or not self._thread.is_alive():
                raise RuntimeError("the MCP test server did not start")
            time.sleep(0.02)
        return self.url

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._uvicorn = self._thread = None

    def __enter__(self) -> McpTestServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m doubles.mcp_server", description="MCP test server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    server = McpTestServer(args.host, args.port)
    print(f"MCP server listening on {server.start()}", flush=True)
    try:
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
