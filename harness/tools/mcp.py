"""Tools of MCP servers, through the official ``mcp`` SDK: streamable HTTP (``url``, optional
``headers`` with ``${NAME}`` read from the environment) and local processes over stdio
(``command``, ``args``, ``env``, ``cwd``), the most common kind.

An agent lists servers in AGENTS_FILE (``mcp_servers = [{name = "files", url = "..."}]``); tool
``read`` of server ``files`` is offered to the model as ``files__read``, beside the Python tools.
A tool whose offered name is not ^[a-zA-Z0-9_-]{1,64}$ is not offered (the log names it).

- One initialized session per (process, server) is kept and reused by every listing and call
  (harness.tools.mcp_session): started at the first use within ``connect_timeout_seconds``
  (default 10), started again when it died, closed at worker shutdown; a stdio server dies with
  its worker. A call waits at most ``timeout_seconds`` (default 60) for its answer; on a timeout
  the server is sent ``notifications/cancelled``.
- The server's listing is read when a loop starts (``AgentDef.tool_names``) and kept
  LISTING_TTL_SECONDS (a failed listing FAILED_LISTING_TTL_SECONDS from when it failed, so a
  server that comes back is noticed soon); ``notifications/tools/list_changed`` drops it.
- The tool annotations decide the crash behaviour only when the agent trusts the server
  (``trust_annotations = true``): ``readOnlyHint`` -> ``read_only``, ``idempotentHint`` ->
  ``idempotent``; otherwise (and when absent) neither. The call carries the call's
  ``idempotency_key`` in ``_meta`` (IDEMPOTENCY_META_KEY) for a server that deduplicates.
- A call that fails before it was sent (refused connection, a command that cannot start, a
  server that never answered ``initialize``) is a TOOL error, and so is a JSON-RPC error the
  server sent; one that fails after it was sent without an answer (a timeout, a closed
  connection: the server died) is "interrupted: may or may not have taken effect", as a
  crash-interrupted call is.
- Every value a server's ``${NAME}`` references stand for (its token) is redacted from every
  result and error of its tools, and from its stderr, which goes to our log (docs/mcp.md).
- A result's text parts and embedded text resources are kept; a binary part is described
  (``[image/png, 48 kB, not shown]``).
- A server that is down never fails the session: while it is down its tools are not offered,
  and a call of one (a listing from before, or a model that remembers it) is a TOOL error result
  naming the server and the error type. A result with ``isError`` is a TOOL error with its text.
- The ``mcp`` package is imported only when an agent lists a server.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from crashpoints import crash_point
from harness.errors import AgentConfigError, Cancelled, DeadlineExceeded, ToolError
from harness.tools.context import ToolContext
from harness.tools.registry import (
    MCP_SEPARATOR,
    McpRoom,
    Tool,
    add_secrets,
    install_mcp,
    safe_message,
    valid_tool_name,
)
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
    #: Longest wait for one call's answer (or one listing's).
    timeout_seconds: float = 60.0
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    cwd: str | None = None
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    trust_annotations: bool = False
    #: Longest start of a session: a stdio server's process and ``initialize``.
    connect_timeout_seconds: float = 10.0

    def references(self) -> set[str]:
        """The environment variables its url, headers, env and args name (``${NAME}``)."""
        texts = [self.url, *self.args, *(v for _, v in self.env), *(v for _, v in self.headers)]
        return {m.group(1) for t in texts for m in ENV_REFERENCE.finditer(t)}

    def secrets(self) -> list[str]:
        """The values its ``${NAME}`` references stand for now (4 characters or more)."""
        values = (os.environ.get(name, "") for name in self.references())
        return sorted((v for v in values if len(v) >= 4), key=len, reverse=True)

    def redact(self, text: str) -> str:
        """``text`` with every value of its references replaced by ``[redacted]``."""
        for secret in self.secrets():
            text = text.replace(secret, "[redacted]")
        return text


def expand(text: str) -> str:
    """``text`` with every ``${NAME}`` replaced by the environment variable's value; KeyError
    (naming the variable) when it is not set."""
    return ENV_REFERENCE.sub(lambda m: os.environ[m.group(1)], text)


#: How long a server's tool listing is used before it is read again.
LISTING_TTL_SECONDS = 60.0
#: How long a failed listing is remembered (its tools not offered) before the server is tried again.
FAILED_LISTING_TTL_SECONDS = 5.0
#: ``_meta`` key of a tools/call that carries ToolContext.idempotency_key.
IDEMPOTENCY_META_KEY = "io.agent-recovery/idempotency-key"
#: Errors that mean the call never reached the server (it cannot have taken effect).
_NOT_SENT = frozenset({"ConnectError", "ConnectTimeout", "FileNotFoundError", "PermissionError", "KeyError"})
#: How much longer than the server's own timeouts the call's thread is given (tool timeout).
_CALL_MARGIN_SECONDS = 10.0
#: JSON-RPC codes the SDK gives a request that got no answer: the connection closed, or its
#: read timeout passed (the request was sent: it may or may not have taken effect).
_CONNECTION_CLOSED = -32000
_REQUEST_TIMEOUT = -32001


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
    add_secrets(secret for server in servers for secret in server.secrets())


def forget() -> None:
    """Forget every server and listing, and close their sessions (tests)."""
    with _lock:
        _servers.clear()
        _listings.clear()
    forget_sessions()


def forget_sessions() -> None:
    """Close every kept session of this process (tests; worker shutdown: ``close_sessions``)."""
    from harness.tools.mcp_session import close_all

    close_all()


def close_sessions() -> None:
    """Close every kept MCP session of this process: worker shutdown."""
    forget_sessions()


def _list_changed(server_name: str) -> None:
    """``notifications/tools/list_changed``: the next lookup lists the server again."""
    with _lock:
        _listings.pop(server_name, None)
    log_event(log, "mcp_tools_changed", server=server_name)


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
    with _lock:
        cached = _listings.get(server.name)
    if cached is not None and cached.fresh(time.monotonic()):
        return cached
    from harness.tools.mcp_session import SessionNotStarted, run

    try:
        listed = run(lambda: _list_tools(server), server.connect_timeout_seconds + server.timeout_seconds)
        listing = _Listing({t.name: t for t in listed}, time.monotonic(), None)
        log_event(log, "mcp_tools_listed", server=server.name, tools=len(listed))
    except Exception as exc:
        kind = exc.reason if isinstance(exc, SessionNotStarted) else _leaf_name(exc)
        error = exc.kind if isinstance(exc, SessionNotStarted) else kind
        log_event(log, "mcp_list_failed", logging.WARNING, server=server.name, error=error)
        # NOTE: stamped when the listing ended, not when it started: a server that hangs for
        # its whole timeout is then left alone for FAILED_LISTING_TTL_SECONDS, not listed again
        # at once by every lookup of every round.
        listing = _Listing({}, time.monotonic(), f"MCP server {server.name!r} is unreachable: {kind}")
    with _lock:
        _listings[server.name] = listing
    return listing


@asynccontextmanager
async def open_client(
    server: McpServer, on_message: Callable[[Any], Awaitable[None]], on_not_sent: Callable[[str], None]
) -> AsyncIterator[Any]:
    """A connected, initialized client of the server, held by the session's owner task
    (harness.tools.mcp_session): a stdio server is a new process, started so that it dies with
    this one, its stderr to our log. ``on_not_sent`` hears of every HTTP request that could not
    connect (its error's type name): that request never reached the server."""
    from mcp import Client

    options: dict[str, Any] = {
        "read_timeout_seconds": server.connect_timeout_seconds,
        "cache": None,
        "message_handler": on_message,
    }
    if server.command:
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        from harness.tools.mcp_session import StderrToLog, launch_command

        command, args = launch_command(expand(server.command), [expand(a) for a in server.args])
        params = StdioServerParameters(
            command=command, args=args, env={k: expand(v) for k, v in server.env} or None, cwd=server.cwd
        )
        stderr = StderrToLog(server.name, server.redact)
        try:
            async with Client(stdio_client(params, errlog=stderr.writer), **options) as client:
                stderr.close_writer()
                yield client
        finally:
            stderr.close_writer()
        return
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    from harness.tools.mcp_session import connect_failures_reported

    headers = {k: expand(v) for k, v in server.headers}
    timeout = httpx2.Timeout(server.connect_timeout_seconds, read=max(server.timeout_seconds, 300.0))
    transport = connect_failures_reported(httpx2.AsyncHTTPTransport(), on_not_sent)
    async with (
        httpx2.AsyncClient(headers=headers, timeout=timeout, transport=transport) as http,
        Client(streamable_http_client(expand(server.url), http_client=http), **options) as client,
    ):
        yield client


async def _list_tools(server: McpServer) -> list[Tool]:
    from harness.tools.mcp_session import session_of

    client = await session_of(server, open_client, _list_changed).client_of()
    out: list[Tool] = []
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
        timeout_seconds=server.connect_timeout_seconds + server.timeout_seconds + _CALL_MARGIN_SECONDS,
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
    """One tools/call on the server's kept session, bounded by the server's timeouts and the
    deadline. Raises McpUnavailable (a TOOL error result) for a server that fails: "failed the
    call" when the call was never sent (the session could not start) or the server answered it
    with a JSON-RPC error, "interrupted ... may or may not have taken effect" when it was sent
    and got no answer (a timeout, a closed connection); DeadlineExceeded when the loop's
    deadline passed meanwhile; Cancelled when the session was cancelled meanwhile."""
    from harness.tools.mcp_session import SessionNotStarted, run

    timeout = server.timeout_seconds
    left = ctx.seconds_left()
    if left is not None:
        if left <= 0:
            raise DeadlineExceeded()
        timeout = min(timeout, left)
    started = time.monotonic()
    try:
        result = run(
            lambda: _call(server, tool_name, args, ctx.idempotency_key, timeout),
            server.connect_timeout_seconds + timeout + 1.0,
            ctx.cancelled,
        )
    except concurrent.futures.CancelledError:
        raise Cancelled(f"cancelled while MCP tool {tool_name!r} ran") from None
    except Exception as exc:
        if left is not None and time.monotonic() - started >= left:
            raise DeadlineExceeded() from None
        kind = _leaf_name(exc)
        log_event(log, "mcp_call_failed", logging.WARNING, server=server.name, tool=tool_name, error=kind)
        if isinstance(exc, SessionNotStarted):
            raise McpUnavailable(f"MCP server {server.name!r} failed the call: {server.redact(exc.reason)}") from None
        if isinstance(exc, _NotSent):
            kind = str(exc)
        if kind in _NOT_SENT:
            raise McpUnavailable(f"MCP server {server.name!r} failed the call: {kind}") from None
        answered = _server_error(exc)
        if answered is not None:
            message = safe_message(Exception(server.redact(answered))) or kind
            raise McpUnavailable(f"MCP server {server.name!r} failed the call: {message}") from None
        why = "connection closed" if _error_code(exc) == _CONNECTION_CLOSED else "TimeoutError"
        if _error_code(exc) is None and not isinstance(exc, TimeoutError):
            why = kind
        raise McpUnavailable(
            f"the call to {tool_name!r} on MCP server {server.name!r} was interrupted ({why}) and may or may "
            "not have taken effect"
        ) from None
    crash_point("mcp.after_call")
    text = server.redact(_text_of(result))
    if result.is_error:
        # One line, cut: the server's error text may be long (a validation dump).
        raise ToolError(safe_message(Exception(text)) or f"MCP tool {tool_name!r} failed")
    return text


async def _call(server: McpServer, tool_name: str, args: dict[str, Any], key: str, timeout: float) -> Any:
    from harness.tools.mcp_session import session_of

    kept = session_of(server, open_client, _list_changed)
    client = await kept.client_of()
    failures = kept.not_sent
    try:
        # The SDK sends ``notifications/cancelled`` for a request whose read timeout passes.
        return await client.call_tool(tool_name, args, read_timeout_seconds=timeout, meta={IDEMPOTENCY_META_KEY: key})
    except Exception as exc:
        if _error_code(exc) != _CONNECTION_CLOSED:
            raise
        await kept.close()  # the next use starts it again
        if kept.not_sent > failures:
            # An HTTP request that could not connect: the call never reached the server.
            raise _NotSent(kept.last_not_sent) from exc
        raise


class _NotSent(Exception):
    """Raised when the transport could not send the call (its error's type name)."""


def _error_code(exc: BaseException) -> int | None:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if type(exc).__name__ not in ("McpError", "MCPError"):
        return None
    code = getattr(exc, "code", None)
    if code is None:
        code = getattr(getattr(exc, "error", None), "code", None)
    return int(code) if isinstance(code, int) else None


def _server_error(exc: BaseException) -> str | None:
    """The message of a JSON-RPC error the server sent (it answered: the call is not in doubt);
    None for the SDK's own errors of a request that got no answer (closed, timed out)."""
    code = _error_code(exc)
    if code is None or code in (_CONNECTION_CLOSED, _REQUEST_TIMEOUT):
        return None
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    message = getattr(getattr(exc, "error", None), "message", None)
    return str(message if message is not None else exc)


#: Bytes per kilobyte in the description of a binary part.
_KB = 1024


def _size(n: int) -> str:
    if n < _KB:
        return f"{n} B"
    if n < _KB * _KB:
        return f"{round(n / _KB)} kB"
    return f"{round(n / _KB / _KB)} MB"


def _described(mime: str | None, base64_data: str | None) -> str:
    """``[image/png, 48 kB, not shown]`` for a binary part the model is not sent."""
    n = len(base64_data or "") * 3 // 4 - (base64_data or "").count("=", -2)
    return f"[{mime or 'application/octet-stream'}, {_size(max(n, 0))}, not shown]"


def _text_of(result: Any) -> str:
    """The result as text: text parts and embedded text resources as they are, a binary part
    (image, audio, blob resource) described, a resource link named; the structured content
    when there is no part."""
    parts: list[str] = []
    for block in result.content:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(_described(getattr(block, "mime_type", None), getattr(block, "data", None)))
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            if text is not None:
                parts.append(text)
            else:
                parts.append(_described(getattr(resource, "mime_type", None), getattr(resource, "blob", None)))
        elif kind == "resource_link":
            parts.append(f"[resource {getattr(block, 'uri', '')}]")
    if parts:
        return "\n".join(parts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return ""


def _leaf_name(exc: BaseException) -> str:
    """The type name of the first error inside (task groups wrap errors in ExceptionGroup)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return type(exc).__name__


# Through the module's names at call time (a test may replace lookup_mcp_tool).
install_mcp(
    McpRoom(lookup=lambda name: lookup_mcp_tool(name), unavailable_reason=lambda name: unavailable_reason(name))
)
