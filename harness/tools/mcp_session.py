"""Kept MCP sessions: one initialized session per (process, server), reused by every call and
listing of that server, whatever thread asks (docs/mcp.md).

- Every session lives on ONE event loop, on a daemon thread of the process (started at the
  first use, and anew in a forked child). A caller on any thread (the tool threads, a threads
  pool's workers) hands a coroutine to that loop and waits for its answer: a session is only
  ever touched by the loop's thread, so no lock guards it.
- A session is opened by an owner task that enters the SDK's client and holds it until the
  session is closed (the SDK's cancel scopes must be left by the task that entered them). Its
  start (a stdio server's process, and ``initialize``) is bounded by ``connect_timeout_seconds``.
- A session found dead at the next use (its connection closed: the server exited) is started
  again; a call is never sent on a dead one.
- A stdio server is started through a small launcher that asks Linux to SIGKILL it when the
  worker dies (``PR_SET_PDEATHSIG``), so that no server outlives a SIGKILLed worker. Its stderr
  goes to our log, a line at a time, with its secrets redacted.
- ``close_all`` (worker shutdown, and at exit) closes every session: a stdio server gets its
  stdin closed, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import sys
import threading
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar

from logfmt import log_event

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest stderr line of a stdio server that reaches our log (the rest is cut).
STDERR_LINE_CHARS = 300
#: Python run before a stdio server's own command: the server gets SIGKILL when the thread
#: that started it (the process's MCP loop thread, alive as long as the process) ends, and does
#: not start at all when its worker died before the request was in place.
_LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class McpServer(Protocol):
    """What a session needs of a server's configuration (harness.tools.mcp.McpServer)."""

    @property
    def name(self) -> str: ...
    @property
    def connect_timeout_seconds(self) -> float: ...


#: Opens a connected, initialized client of a server (harness.tools.mcp.open_client): given the
#: server, a handler of the server's notifications and a hearer of requests never sent.
Opener = Callable[
    [Any, Callable[[Any], Coroutine[Any, Any, None]], Callable[[str], None]], AbstractAsyncContextManager[Any]
]


class SessionNotStarted(Exception):
    """Raised when a server's session cannot be started (its process or ``initialize``): no call
    was sent on it."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        #: The error's type name (``TimeoutError``, ``ConnectError``), for the log.
        self.kind = kind


# --- the loop thread ---------------------------------------------------------------------------

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="mcp-sessions", daemon=True).start()
            _loop = loop
        return _loop


def run(make: Callable[[], Coroutine[Any, Any, T]], timeout: float, cancelled: Callable[[], bool] | None = None) -> T:
    """Run ``make()`` on the sessions' loop and wait at most ``timeout`` seconds for it
    (TimeoutError, after the coroutine is cancelled); ``cancelled`` is asked every 0.1 s, and a
    True stops the wait at once (the coroutine is cancelled; CancelledError)."""
    future = asyncio.run_coroutine_threadsafe(make(), _event_loop())
    waited = 0.0
    while True:
        step = min(0.1, timeout - waited) if cancelled is not None else timeout - waited
        try:
            return future.result(max(step, 0.0))
        except concurrent.futures.TimeoutError:
            waited += step
            if cancelled is not None and _asked(cancelled):
                future.cancel()
                raise concurrent.futures.CancelledError() from None
            if waited >= timeout:
                future.cancel()
                raise TimeoutError() from None


def _asked(cancelled: Callable[[], bool]) -> bool:
    # A cancellation that cannot be read now (the database does not answer) is not one: the
    # call goes on, and the loop meets the outage at its next write.
    try:
        return bool(cancelled())
    except Exception:
        return False


# --- sessions ----------------------------------------------------------------------------------


class KeptSession:
    """The session of one server in this process. Used on the loop's thread only."""

    def __init__(self, server: McpServer, opener: Opener, on_list_changed: Callable[[str], None]) -> None:
        self.server = server
        self._opener = opener
        self.client: Any = None
        self.starts = 0
        #: How many HTTP requests could not connect, and the type name of the latest error.
        self.not_sent = 0
        self.last_not_sent = ""
        self._on_list_changed = on_list_changed
        self._closing: asyncio.Event | None = None
        self._owner: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def alive(self) -> bool:
        """True while the session is open and its connection not closed."""
        if self.client is None or self._owner is None or self._owner.done():
            return False
        try:
            dispatcher = self.client.session._dispatcher
        except Exception:
            return True
        return not getattr(dispatcher, "_closed", False)

    async def client_of(self) -> Any:
        """The open client, started (again) when there is none or it died. Raises
        SessionNotStarted when it cannot be started within ``connect_timeout_seconds``."""
        async with self._lock:
            if self.alive():
                return self.client
            if self.client is not None:
                log_event(log, "mcp_session_died", logging.WARNING, server=self.server.name)
                await self._close()
            return await self._start()

    async def _start(self) -> Any:
        ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._closing = asyncio.Event()
        self._owner = asyncio.ensure_future(self._own(ready, self._closing))
        limit = self.server.connect_timeout_seconds
        try:
            self.client = await asyncio.wait_for(asyncio.shield(ready), limit)
        except TimeoutError:
            ready.cancel()
            await self._close()
            raise SessionNotStarted(f"no answer to initialize within {limit:g} seconds", "TimeoutError") from None
        except Exception as exc:
            await self._close()
            raise SessionNotStarted(_leaf_name(exc), _leaf_name(exc)) from None
        except asyncio.CancelledError:
            ready.cancel()
            await self._close()
            raise
        self.starts += 1
        log_event(log, "mcp_session_started", server=self.server.name, starts=self.starts)
        return self.client

    async def _own(self, ready: asyncio.Future[Any], closing: asyncio.Event) -> None:
        try:
            async with self._opener(self.server, self._notified, self._not_sent) as client:
                if not ready.done():
                    ready.set_result(client)
                await closing.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(type(exc).__name__))
            if not isinstance(exc, Exception):
                raise

    def _not_sent(self, kind: str) -> None:
        # An HTTP request that could not connect: the call it carried fails with the SDK's
        # "connection closed"; this says that it never reached the server.
        self.not_sent += 1
        self.last_not_sent = kind

    async def _notified(self, message: Any) -> None:
        if getattr(message, "method", None) == "notifications/tools/list_changed":
            self._on_list_changed(self.server.name)

    async def _close(self) -> None:
        owner, closing = self._owner, self._closing
        self.client, self._owner, self._closing = None, None, None
        if owner is None or closing is None:
            return
        closing.set()
        try:
            await asyncio.wait_for(asyncio.shield(owner), 10.0)
        except (TimeoutError, Exception):
            owner.cancel()
        except asyncio.CancelledError:
            owner.cancel()
            raise

    async def close(self) -> None:
        async with self._lock:
            await self._close()


#: The sessions of this process, by server name.
_sessions: dict[str, KeptSession] = {}


def session_of(server: McpServer, opener: Opener, on_list_changed: Callable[[str], None]) -> KeptSession:
    """The kept session of ``server`` (a new one when its configuration changed). Call on the
    loop's thread."""
    kept = _sessions.get(server.name)
    if kept is not None and kept.server == server:
        return kept
    fresh = KeptSession(server, opener, on_list_changed)
    _sessions[server.name] = fresh
    if kept is not None:
        _closing.add(task := asyncio.ensure_future(kept.close()))
        task.add_done_callback(_closing.discard)
    return fresh


#: Closes of replaced sessions still running (a reference keeps each task alive).
_closing: set[asyncio.Future[None]] = set()


def close_all(timeout: float = 15.0) -> None:
    """Close every kept session of this process (worker shutdown); waits at most ``timeout``."""
    if _loop is None or not _sessions:
        return

    async def closing() -> None:
        kept = list(_sessions.values())
        _sessions.clear()
        await asyncio.gather(*(k.close() for k in kept), return_exceptions=True)

    try:
        run(closing, timeout)
    except Exception as exc:
        log_event(log, "mcp_sessions_close_failed", logging.WARNING, error=type(exc).__name__)


def started(server_name: str) -> int:
    """How many times the server's session was started in this process (tests, bench)."""
    kept = _sessions.get(server_name)
    return kept.starts if kept is not None else 0


def _after_fork_in_child() -> None:
    # A forked process has none of its parent's threads: no loop runs its sessions there. The
    # parent's server processes are the parent's (their pipes are closed with the fork's copy).
    global _loop
    _loop = None
    _sessions.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(close_all, 5.0)


# --- stdio launch and stderr -------------------------------------------------------------------


def launch_command(command: str, args: list[str]) -> tuple[str, list[str]]:
    """The command line that starts a stdio server so that it dies with this process (Linux:
    the parent-death signal); elsewhere the server's own command."""
    if not sys.platform.startswith("linux"):
        return command, args
    return sys.executable, ["-S", "-c", _LAUNCHER, str(os.getpid()), command, *args]


class StderrToLog:
    """A pipe whose write end a stdio server gets as its stderr; a thread reads its lines and
    logs each one (``mcp_server_stderr``), secrets redacted, cut to STDERR_LINE_CHARS."""

    def __init__(self, server_name: str, redact: Callable[[str], str]) -> None:
        read_fd, write_fd = os.pipe()
        self.writer = os.fdopen(write_fd, "w")
        self._reader = os.fdopen(read_fd, "rb")
        self._server_name, self._redact = server_name, redact
        threading.Thread(target=self._pump, name="mcp-stderr", daemon=True).start()

    def _pump(self) -> None:
        with self._reader:
            for raw in self._reader:
                line = self._redact(raw.decode("utf-8", "replace").rstrip())
                if line:
                    log_event(log, "mcp_server_stderr", server=self._server_name, line=line[:STDERR_LINE_CHARS])

    def close_writer(self) -> None:
        """Our copy of the write end, once the server holds its own (EOF comes when it exits)."""
        if not self.writer.closed:
            self.writer.close()


def connect_failures_reported(inner: Any, report: Callable[[str], None]) -> Any:
    """An HTTP transport that tells ``report`` of every request that could not connect (the
    error's type name) before it raises: such a request never reached the server."""
    import httpx2

    class Reporting(httpx2.AsyncBaseTransport):
        async def handle_async_request(self, request: Any) -> Any:
            try:
                return await inner.handle_async_request(request)
            except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
                report(type(exc).__name__)
                raise

        async def aclose(self) -> None:
            await inner.aclose()

    return Reporting()


def _leaf_name(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return type(exc).__name__


__all__ = [
    "KeptSession",
    "SessionNotStarted",
    "StderrToLog",
    "close_all",
    "launch_command",
    "run",
    "session_of",
    "started",
]
