"""Tools of MCP servers, through the official ``mcp`` SDK: streamable HTTP (``url``, optional
``headers`` with ``${NAME}`` read from the environment) and local processes over stdio
(``command``, ``args``, ``env``, ``cwd``), the most common kind.

An agent lists servers in AGENTS_FILE (``mcp_servers = [{name = "files", url = "..."}]``); tool
``read`` of server ``files`` is offered to the model as ``files__read``, beside the Python tools.
A tool whose offered name is not ^[a-zA-Z0-9_-]{1,64}$ is not offered (the log names it).

- The server's listing is read when a loop starts (``AgentDef.tool_names``) and kept
  LISTING_TTL_SECONDS (a failed listing FAILED_LISTING_TTL_SECONDS, so a server that comes back
  is noticed soon). A call opens its own session: a worker holds no MCP connection between rounds.
- The tool annotations decide the crash behaviour only when the agent trusts the server
  (``trust_annotations = true``): ``readOnlyHint`` -> ``read_only``, ``idempotentHint`` ->
  ``idempotent``; otherwise (and when absent) neither. The call carries the call's
  ``idempotency_key`` in ``_meta`` (IDEMPOTENCY_META_KEY) for a server that deduplicates.
- A call that fails before it reached the server (refused connection, a command that cannot
  start) is a TOOL error; one that fails after it was sent (a timeout, a dropped stream) is
  "interrupted: may or may not have taken effect", as a crash-interrupted call is.
- A server that is down never fails the session: while it is down its tools are not offered,
  and a call of one (a listing from before, or a model that remembers it) is a TOOL error result
  naming the server and the error type. A result with ``isError`` is a TOOL error with its text.
- The ``mcp`` package is imported only when an agent lists a server.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from crashpoints import crash_point
from harness.errors import AgentConfigError, DeadlineExceeded, ToolError
from harness.tools.context import ToolContext
from harness.tools.registry import MCP_SEPARATOR, McpRoom, Tool, install_mcp, safe_message, valid_tool_name
from logfmt import log_event

log = logging.getLogger(__name__)

#: ``${NAME}`` in an MCP server's headers, env and args: read from the environment at each use.
ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class McpServer:
    """An MCP server whose tools an agent is offered as ``<name>__<tool>``: streamable HTTP
    (``url``, optional ``headers``) or a local process over stdio (``command``, ``args``,
    ``env``, ``cwd``). ``${NAME}`` in headers, env and args is read from the environment at each
    use (a token never sits in the configuration, and is never logged). Its tools' annotations
    (``readOnlyHint``, ``idempotentHint``) decide whether a call interrupted by a crash runs
    again only when ``trust_annotations`` is set: a server says what it likes about itself."""

    name: str
    url: str = ""
    timeout_seconds: float = 10.0
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    cwd: str | None = None
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    trust_annotations: bool = False

    def references(self) -> set[str]:
        """The environment variables its headers, env and args name (``${NAME}``)."""
        texts = [*self.args, *(v for _, v in self.env), *(v for _, v in self.headers)]
        return {m.group(1) for t in texts for m in ENV_REFERENCE.finditer(t)}


def expand(text: str) -> str:
    """``text`` with every ``${NAME}`` replaced by the environment variable's value; KeyError
    (naming the variable) when it is not set."""
    return ENV_REFERENCE.sub(lambda m: os.environ[m.group(1)], text)


T = TypeVar("T")

#: How long a server's tool listing is used before it is read again.
LISTING_TTL_SECONDS = 60.0
#: How long a failed listing is remembered (its tools not offered) before the server is tried again.
FAILED_LISTING_TTL_SECONDS = 5.0
#: ``_meta`` key of a tools/call that carries ToolContext.idempotency_key.
IDEMPOTENCY_META_KEY = "io.agent-recovery/idempotency-key"
#: Errors that mean the call never reached the server (it cannot have taken effect).
_NOT_SENT = frozenset({"ConnectError", "ConnectTimeout", "FileNotFoundError", "PermissionError", "KeyError"})
#: How much longer than the server's own timeout the call's thread is given (tool timeout).
_CALL_MARGIN_SECONDS = 10.0


class McpUnavailable(ToolError):
    """Raised when an MCP server cannot be reached or fails a call; its message is the TOOL result."""


@dataclass
class _Listing:
    tools: dict[str, Tool] = field(default_factory=dict)
    fetched_at: float = 0.0
    error: str | None = None

    def fresh(self, now: float) -> bool:
        ttl = FAILED_LISTING_TTL_SECONDS if self.error else LISTING_TTL_SECONDS
        return now - self.fetched_at < ttl


_servers: dict[str, McpServer] = {}
_listings: dict[str, _Listing] = {}
_lock = threading.Lock()


def configure(servers: Iterable[McpServer]) -> None:
    """Know these servers (load_at_start: every server of every agent). Raises AgentConfigError
    when a server is listed and the ``mcp`` package is not installed."""
    servers = list(servers)
    if not servers:
        return
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise AgentConfigError(
            f"AGENTS_FILE lists MCP server {servers[0].name!r}, but the mcp package is not installed "
            "(pip install 'agent-recovery[mcp]')"
        ) from None
    # The HTTP client logs every request line (the URL may carry credentials) at INFO.
    for noisy in ("httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger(noisy).level))
    with _lock:
        for server in servers:
            _servers[server.name] = server


def forget() -> None:
    """Forget every server and listing (tests)."""
    with _lock:
        _servers.clear()
        _listings.clear()


def server_tool_names(server: McpServer) -> tuple[str, ...]:
    """The names of the server's tools as offered to the model; () while it cannot be listed."""
    with _lock:
        _servers.setdefault(server.name, server)
    return tuple(_listing(server).tools)


def lookup_mcp_tool(name: str) -> Tool | None:
    """The MCP tool of that offered name, when its server is configured and could be listed."""
    server = _server_of(name)
    if server is None:
        return None
    return _listing(server).tools.get(name)


def unavailable_reason(name: str) -> str:
    """Why the tools of the name's server are not offered now ("" when they are, or it is not an
    MCP server's name)."""
    server = _server_of(name)
    if server is None:
        return ""
    return _listing(server).error or ""


def _server_of(name: str) -> McpServer | None:
    prefix, sep, _ = name.partition(MCP_SEPARATOR)
    if not sep:
        return None
    with _lock:
        return _servers.get(prefix)


def _listing(server: McpServer) -> _Listing:
    now = time.monotonic()
    with _lock:
        cached = _listings.get(server.name)
    if cached is not None and cached.fresh(now):
        return cached
    try:
        listed = _run(lambda: _list_tools(server), server.timeout_seconds)
        listing = _Listing({t.name: t for t in listed}, now, None)
        log_event(log, "mcp_tools_listed", server=server.name, tools=len(listed))
    except Exception as exc:
        kind = _leaf_name(exc)
        log_event(log, "mcp_list_failed", logging.WARNING, server=server.name, error=kind)
        listing = _Listing({}, now, f"MCP server {server.name!r} is unreachable: {kind}")
    with _lock:
        _listings[server.name] = listing
    return listing


@asynccontextmanager
async def _client(server: McpServer) -> AsyncIterator[Any]:
    """A connected client of the server (a new session: a stdio server is a new process)."""
    from mcp import Client

    if server.command:
        from mcp import StdioServerParameters

        params = StdioServerParameters(
            command=server.command,
            args=[expand(a) for a in server.args],
            env={k: expand(v) for k, v in server.env} or None,
            cwd=server.cwd,
        )
        async with Client(params, read_timeout_seconds=server.timeout_seconds, cache=None) as client:
            yield client
    elif server.headers:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        headers = {k: expand(v) for k, v in server.headers}
        timeout = httpx2.Timeout(server.timeout_seconds, read=max(server.timeout_seconds, 300.0))
        async with httpx2.AsyncClient(headers=headers, timeout=timeout) as http:
            transport = streamable_http_client(server.url, http_client=http)
            async with Client(transport, read_timeout_seconds=server.timeout_seconds, cache=None) as client:
                yield client
    else:
        async with Client(server.url, read_timeout_seconds=server.timeout_seconds, cache=None) as client:
            yield client


async def _list_tools(server: McpServer) -> list[Tool]:
    out: list[Tool] = []
    async with _client(server) as client:
        cursor: str | None = None
        while True:
            page = await client.list_tools(cursor=cursor)
            for remote in page.tools:
                entry = _tool_of(server, remote)
                if entry is not None:
                    out.append(entry)
            cursor = page.next_cursor
            if not cursor:
                return out


def _tool_of(server: McpServer, remote: Any) -> Tool | None:
    name = f"{server.name}{MCP_SEPARATOR}{remote.name}"
    if not valid_tool_name(name):
        log_event(
            log, "mcp_tool_skipped", logging.WARNING, server=server.name, tool=name[:100], reason="name_not_allowed"
        )
        return None
    annotations = remote.annotations if server.trust_annotations else None
    remote_name = str(remote.name)

    def run(ctx: ToolContext, args: dict[str, Any]) -> str:
        return call_tool(server, remote_name, args, ctx)

    return Tool(
        name=name,
        description=remote.description or "",
        parameters=dict(remote.input_schema or {"type": "object", "properties": {}}),
        run=run,
        read_only=bool(annotations and annotations.read_only_hint),
        idempotent=bool(annotations and annotations.idempotent_hint),
        destructive=_destructive(annotations),
        module=f"mcp:{server.name}",
        qualname=remote_name,
        timeout_seconds=server.timeout_seconds + _CALL_MARGIN_SECONDS,
    )


def _destructive(annotations: Any) -> bool | None:
    """MCP's ``destructiveHint``: None when absent (the spec's default reads as destructive);
    False for a read-only tool (the spec ignores the hint there)."""
    if annotations is None:
        return None
    if annotations.read_only_hint:
        return False
    hint = annotations.destructive_hint
    return None if hint is None else bool(hint)


def call_tool(server: McpServer, tool_name: str, args: dict[str, Any], ctx: ToolContext) -> str:
    """One tools/call in its own session, bounded by the server's timeout and the deadline.
    Raises McpUnavailable (a TOOL error result) for a server that fails: "failed the call" when
    the call never reached it, "interrupted ... may or may not have taken effect" when it may
    have (a timeout or a stream lost after the request was sent); DeadlineExceeded when the
    loop's deadline passed meanwhile."""
    timeout = server.timeout_seconds
    left = ctx.seconds_left()
    if left is not None:
        if left <= 0:
            raise DeadlineExceeded()
        timeout = min(timeout, left)
    started = time.monotonic()
    try:
        result = _run(lambda: _call(server, tool_name, args, ctx.idempotency_key), timeout)
    except Exception as exc:
        if left is not None and time.monotonic() - started >= left:
            raise DeadlineExceeded() from None
        kind = _leaf_name(exc)
        log_event(log, "mcp_call_failed", logging.WARNING, server=server.name, tool=tool_name, error=kind)
        if kind in _NOT_SENT or _is_protocol_error(exc):
            raise McpUnavailable(f"MCP server {server.name!r} failed the call: {kind}") from None
        raise McpUnavailable(
            f"the call to {tool_name!r} on MCP server {server.name!r} was interrupted ({kind}) and may or may "
            "not have taken effect"
        ) from None
    crash_point("mcp.after_call")
    text = _text_of(result)
    if result.is_error:
        # One line, cut: the server's error text may be long (a validation dump).
        raise ToolError(safe_message(Exception(text)) or f"MCP tool {tool_name!r} failed")
    return text


async def _call(server: McpServer, tool_name: str, args: dict[str, Any], key: str) -> Any:
    async with _client(server) as client:
        return await client.call_tool(tool_name, args, meta={IDEMPOTENCY_META_KEY: key})


def _is_protocol_error(exc: BaseException) -> bool:
    """True when the server answered the call with a JSON-RPC error: it answered, so the call
    is not in doubt."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return type(exc).__name__ in ("McpError", "MCPError")


def _text_of(result: Any) -> str:
    texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
    if texts:
        return "\n".join(texts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return ""


def _run(make: Callable[[], Awaitable[T]], timeout: float) -> T:
    """Run one coroutine to its end on a new event loop, within ``timeout`` seconds (TimeoutError)."""
    import anyio

    async def bounded() -> T:
        with anyio.fail_after(timeout):
            return await make()

    return anyio.run(bounded)


def _leaf_name(exc: BaseException) -> str:
    """The type name of the first error inside (task groups wrap errors in ExceptionGroup)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return type(exc).__name__


# Through the module's names at call time (a test may replace lookup_mcp_tool).
install_mcp(
    McpRoom(lookup=lambda name: lookup_mcp_tool(name), unavailable_reason=lambda name: unavailable_reason(name))
)
