"""A TCP fault proxy for tests: put it between a client and PostgreSQL or Redis and break things.

An asyncio proxy on a loopback port, run by its own event loop in a background thread (no
server to install). Faults, each switched on and off from the test's thread:

- ``cut_all()``: reset every open connection now (a pooler restart, a failover).
- ``refuse_for(seconds)``: stop listening, so new connections get ECONNREFUSED (the server is
  down); open connections stay unless ``cut_open=True``. ``mode="reset"`` accepts and resets
  instead (a pooler that takes the connection and drops it).
- ``cut_after(ms)``: every connection opened from now on is reset ``ms`` after it opened.
- ``cut_on(pattern)``: reset the connection when a chunk containing ``pattern`` passes (by
  default client to server), so a test hits one statement inside a transaction:
  ``cut_on(b"COMMIT")`` or ``cut_on(b"INSERT INTO message")``. ``when="before"`` drops the
  chunk: the server never sees it, and PostgreSQL rolls the transaction back. ``when="after"``
  delivers it and then closes the server side cleanly, so the server executes it while the
  client only sees its connection die: the commit that happened although the client got an
  error.
- ``freeze_on(pattern)``: FREEZE the connection that carries ``pattern`` instead of cutting it:
  that chunk and everything after it, both ways, is held (not forwarded, not read further), and
  the TCP connections stay up (the proxy's kernel still acknowledges what the client sends and
  answers its keepalives), so the client waits on its socket for ever: a connection frozen in a
  live process. ``thaw()`` forwards what was held and pumps again.

A cut is a TCP reset (SO_LINGER 0) towards each side that must see a failure: psycopg2 raises
OperationalError, redis-py ConnectionError, and PostgreSQL aborts the backend's transaction.

    with FaultProxy.for_url(pg_url) as proxy:
        engine = create_engine(proxy.rewrite(pg_url))
        proxy.cut_on(b"COMMIT", times=1)
        ...
        assert proxy.stats().cuts == 1
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

Direction = Literal["up", "down"]  #: up: client to server; down: server to client
When = Literal["before", "after"]
RefuseMode = Literal["refuse", "reset"]

DEFAULT_PORTS = {"postgresql": 5432, "postgres": 5432, "redis": 6379, "rediss": 6380}
CHUNK_BYTES = 64 * 1024
CONTROL_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class Stats:
    """A consistent snapshot of the proxy's counters."""

    connections: int  #: accepted and connected upstream, ever
    active: int  #: open right now
    cuts: int  #: connections reset by a fault (cut_all, cut_after, cut_on, reset mode)
    frozen: int  #: connections frozen by freeze_on, ever
    pattern_hits: int  #: cut_on matches
    refused: int  #: connections reset at accept in refuse_for(mode="reset")
    upstream_failures: int  #: accepted, but the upstream server did not take the connection
    bytes_up: int
    bytes_down: int


@dataclass
class _Rule:
    pattern: bytes
    direction: Direction
    when: When
    remaining: int | None  #: cuts left; None: every match
    freeze: bool = False  #: hold the connection instead of cutting it


@dataclass(eq=False)
class _Conn:
    id: int
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    closed: bool = False
    #: Set while bytes flow; cleared by a freeze (both pumps wait on it before writing).
    flowing: asyncio.Event = field(default_factory=asyncio.Event)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0): the peer's next read fails at once."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """See the module docstring. ``start()``/``stop()`` and every control are thread-safe: a
    control runs on the proxy's loop and returns once it is in force."""

    def __init__(self, upstream_host: str, upstream_port: int, listen_host: str = "127.0.0.1", listen_port: int = 0):
        self.upstream = (upstream_host, upstream_port)
        self.listen_host = listen_host
        self._listen_port = listen_port
        self._life = threading.Lock()  # serializes start and stop
        self._lock = threading.Lock()  # guards the counters and the open connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._conns: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self._rules: list[_Rule] = []
        self._cut_after_seconds: float | None = None
        self._refuse_mode: RefuseMode | None = None
        self._refuse_handle: asyncio.TimerHandle | None = None
        self._counts = dict.fromkeys(
            ("connections", "cuts", "frozen", "pattern_hits", "refused", "upstream_failures", "bytes_up", "bytes_down"),
            0,
        )

    @classmethod
    def for_url(cls, url: str) -> FaultProxy:
        """A proxy in front of the server a ``postgresql://`` / ``redis://`` URL names."""
        parts = urlsplit(url)
        scheme = parts.scheme.split("+", 1)[0]
        return cls(parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORTS[scheme])

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if not self._listen_port:
            raise RuntimeError("the proxy is not started")
        return self._listen_port

    def rewrite(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's (user, path and query kept)."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo + '@' if userinfo else ''}{self.listen_host}:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def start(self) -> FaultProxy:
        with self._life:
            if self._thread is not None:
                raise RuntimeError("the proxy is already started")
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            thread = threading.Thread(target=self._run_loop, args=(loop, ready), name="faultproxy", daemon=True)
            thread.start()
            ready.wait()
            self._loop, self._thread = loop, thread
        try:
            self._call(self._listen)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Reset every open connection, stop listening, end the loop thread. Idempotent."""
        with self._life:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None:
                return
            with contextlib.suppress(RuntimeError):
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(CONTROL_TIMEOUT_SECONDS)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(CONTROL_TIMEOUT_SECONDS)
            loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # --- controls (any thread) ----------------------------------------------------------------

    def cut_all(self) -> int:
        """Reset every open connection now; returns how many."""
        return int(self._call(self._cut_all))

    def refuse_for(self, seconds: float, *, cut_open: bool = False, mode: RefuseMode = "refuse") -> None:
        """New connections fail for ``seconds`` (see the module docstring for the modes)."""
        self._call(self._refuse, seconds, cut_open, mode)

    def cut_after(self, ms: float | None) -> None:
        """Reset each connection opened from now on ``ms`` after it opened; None switches off."""
        self._call(setattr, self, "_cut_after_seconds", None if ms is None else ms / 1000.0)

    def cut_on(
        self, pattern: bytes, *, times: int | None = 1, direction: Direction = "up", when: When = "before"
    ) -> None:
        """Reset the connection that carries ``pattern`` (``times`` matches; None: every one)."""
        if not pattern:
            raise ValueError("an empty pattern would match every chunk")
        self._call(self._rules.append, _Rule(pattern, direction, when, times))

    def freeze_on(self, pattern: bytes, *, times: int | None = 1, direction: Direction = "up") -> None:
        """Freeze the connection that carries ``pattern`` (``times`` matches; None: every one),
        before that chunk is forwarded: see the module docstring."""
        if not pattern:
            raise ValueError("an empty pattern would match every chunk")
        self._call(self._rules.append, _Rule(pattern, direction, "before", times, freeze=True))

    def thaw(self) -> int:
        """Let every frozen connection flow again (what was held goes first); returns how many."""
        return int(self._call(self._thaw))

    def clear(self) -> None:
        """Switch every fault off (listening again if refusing); open connections stay (a
        frozen one stays frozen: ``thaw`` it)."""
        self._call(self._clear)

    def stats(self) -> Stats:
        with self._lock:
            return Stats(active=len(self._conns), **self._counts)

    # --- the loop side --------------------------------------------------------------------------

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = self._loop
        if loop is None:
            raise RuntimeError("the proxy is not started")

        async def run() -> Any:
            result = fn(*args)
            return await result if inspect.isawaitable(result) else result

        return asyncio.run_coroutine_threadsafe(run(), loop).result(CONTROL_TIMEOUT_SECONDS)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self._listen_port, reuse_address=True)
        self._listen_port = int(self._server.sockets[0].getsockname()[1])

    async def _unlisten(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _shutdown(self) -> None:
        self._clear_refusal()
        await self._unlisten()
        self._cut_all()
        tasks = [t for conn in list(self._conns.values()) for t in conn.tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _clear(self) -> Any:
        self._rules.clear()
        self._cut_after_seconds = None
        refusing = self._refuse_mode == "refuse"
        self._clear_refusal()
        return self._listen() if refusing and self._server is None else None

    def _clear_refusal(self) -> None:
        if self._refuse_handle is not None:
            self._refuse_handle.cancel()
            self._refuse_handle = None
        self._refuse_mode = None

    async def _refuse(self, seconds: float, cut_open: bool, mode: RefuseMode) -> None:
        assert self._loop is not None
        if self._refuse_mode == "refuse" and mode == "reset":
            await self._listen()
        self._clear_refusal()
        self._refuse_mode = mode
        if mode == "refuse":
            await self._unlisten()
        if cut_open:
            self._cut_all()

        def end() -> None:
            was = self._refuse_mode
            self._refuse_handle = None
            self._refuse_mode = None
            if was == "refuse" and self._server is None:
                assert self._loop is not None
                self._loop.create_task(self._listen())

        self._refuse_handle = self._loop.call_later(seconds, end)

    def _thaw(self) -> int:
        frozen = [conn for conn in self._conns.values() if not conn.flowing.is_set()]
        for conn in frozen:
            conn.flowing.set()
        return len(frozen)

    def _cut_all(self) -> int:
        conns = list(self._conns.values())
        for conn in conns:
            self._cut(conn)
        return len(conns)

    def _cut(self, conn: _Conn, graceful_side: asyncio.StreamWriter | None = None) -> None:
        """Reset both sides of ``conn``; ``graceful_side`` is closed with a FIN instead, after
        what was written to it (the server must still read a delivered chunk)."""
        if conn.closed:
            return
        self._count("cuts")
        for writer in (conn.client, conn.upstream):
            if writer is graceful_side:
                writer.close()
            else:
                _reset(writer)
        self._forget(conn)

    def _forget(self, conn: _Conn) -> None:
        conn.closed = True
        conn.flowing.set()  # a pump holding a frozen chunk wakes, sees the end and stops
        if conn.timer is not None:
            conn.timer.cancel()
        with self._lock:
            self._conns.pop(conn.id, None)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refuse_mode == "reset":
            self._count("refused")
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            self._count("upstream_failures")
            _reset(writer)
            return
        conn = _Conn(next(self._ids), writer, up_writer)
        conn.flowing.set()
        with self._lock:
            self._conns[conn.id] = conn
            self._counts["connections"] += 1
        if self._cut_after_seconds is not None:
            assert self._loop is not None
            conn.timer = self._loop.call_later(self._cut_after_seconds, self._cut, conn)
        down = asyncio.ensure_future(self._pump(conn, up_reader, writer, "down"))
        conn.tasks = [t for t in (asyncio.current_task(), down) if t is not None]
        await self._pump(conn, reader, up_writer, "up")

    def _match(self, direction: Direction, window: bytes) -> _Rule | None:
        for rule in self._rules:
            if rule.direction == direction and rule.pattern in window:
                if rule.remaining is not None:
                    rule.remaining -= 1
                    if rule.remaining <= 0:
                        self._rules.remove(rule)
                self._count("pattern_hits")
                return rule
        return None

    async def _pump(
        self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: Direction
    ) -> None:
        tail = b""
        try:
            while not conn.closed:
                data = await reader.read(CHUNK_BYTES)
                if not data or conn.closed:
                    break
                # NOTE: the window keeps the end of the previous chunk, so a pattern split
                # across two TCP reads still matches.
                window = tail + data
                keep = max((len(r.pattern) for r in self._rules), default=1) - 1
                tail = window[-keep:] if keep else b""
                rule = self._match(direction, window)
                if rule is not None and rule.freeze:
                    if conn.flowing.is_set():
                        self._count("frozen")
                    conn.flowing.clear()
                    rule = None
                elif rule is not None and rule.when == "before":
                    self._cut(conn)
                    return
                if not conn.flowing.is_set():
                    # Frozen: hold this chunk and read nothing more until thawed (or cut).
                    await conn.flowing.wait()
                    if conn.closed:
                        break
                writer.write(data)
                self._count("bytes_up" if direction == "up" else "bytes_down", len(data))
                if rule is not None:
                    await writer.drain()
                    self._cut(conn, graceful_side=writer)
                    return
                await writer.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        # One side ended (or failed): close both, gently, unless a cut got there first.
        if not conn.closed:
            for w in (conn.client, conn.upstream):
                w.close()
            self._forget(conn)
