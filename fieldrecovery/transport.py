"""HTTP sessions for the Open API client: every socket watched from connect, one csrf_token cookie.

``watched_session(watchdog)`` returns a ``requests.Session`` whose connections hand each new
socket to the watchdog the moment it is connected, before the request is written: at the
deadline the watchdog shuts it down, which wakes a read blocked anywhere, including the wait
for the status line and headers (urllib3's timeouts are per operation, so a server that sends
its headers one byte at a time defeats any read timeout). The watchdog keeps a ``dup`` of the
socket, so a TLS wrap (which detaches the original object) does not hide it.

The session's cookie jar keeps the cookies a platform or a load balancer sets (stickiness), but
never a ``csrf_token``: the client sends its own fresh token with each request, and a jar copy
would go out as a second ``csrf_token`` cookie that Go and Spring servers read first (403).
"""

from __future__ import annotations

import socket
from http.cookiejar import Cookie, DefaultCookiePolicy
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from fieldrecovery.deadline import Watchdog

#: The double-submit cookie name; the header is X-CSRF-Token.
CSRF_COOKIE = "csrf_token"


class _NoCsrfCookiePolicy(DefaultCookiePolicy):
    """Store what servers set, except a csrf_token: ours is the only one we ever send."""

    def set_ok(self, cookie: Cookie, request: Any) -> bool:
        return cookie.name != CSRF_COOKIE and bool(super().set_ok(cookie, request))


def _pool_classes(watchdog: Watchdog) -> dict[str, type[HTTPConnectionPool]]:
    class WatchedHTTPConnection(HTTPConnection):
        def _new_conn(self) -> socket.socket:
            sock = super()._new_conn()
            watchdog.watch_socket(sock)
            return sock

    class WatchedHTTPSConnection(HTTPSConnection):
        def _new_conn(self) -> socket.socket:
            sock = super()._new_conn()
            watchdog.watch_socket(sock)
            return sock

    class WatchedHTTPConnectionPool(HTTPConnectionPool):
        ConnectionCls = WatchedHTTPConnection

    class WatchedHTTPSConnectionPool(HTTPSConnectionPool):
        ConnectionCls = WatchedHTTPSConnection

    return {"http": WatchedHTTPConnectionPool, "https": WatchedHTTPSConnectionPool}


class _WatchedAdapter(HTTPAdapter):
    def __init__(self, watchdog: Watchdog) -> None:
        self._watchdog = watchdog
        super().__init__(pool_connections=1, pool_maxsize=2, max_retries=0)

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any) -> None:
        super().init_poolmanager(connections, maxsize, block=block, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = _pool_classes(self._watchdog)


def watched_session(watchdog: Watchdog) -> requests.Session:
    """A Session for ONE call: its sockets are the watchdog's to cut; no csrf_token is stored."""
    http = requests.Session()
    adapter = _WatchedAdapter(watchdog)
    http.mount("http://", adapter)
    http.mount("https://", adapter)
    http.cookies.set_policy(_NoCsrfCookiePolicy())
    return http


#: Bytes asked of urllib3 per read of a non-stream body (decoded: urllib3 bounds its decoder).
BODY_CHUNK_BYTES = 8192


def read_capped(response: requests.Response, limit: int) -> bytes | None:
    """The decoded body of ``response``, or None when it has more than ``limit`` decoded bytes.

    Never ``response.content``: that reads (and decompresses) the whole body before anyone can
    slice it, so a small gzip body could grow the process by gigabytes. urllib3 (>= 2.6) bounds
    its decoder by the amount asked, so at most ``limit + BODY_CHUNK_BYTES`` bytes are held. The
    caller's watchdog bounds the time.
    """
    parts: list[bytes] = []
    total = 0
    raw = response.raw
    while total <= limit:
        data = raw.read(min(BODY_CHUNK_BYTES, limit + 1 - total), decode_content=True)
        if not data:
            return b"".join(parts)
        parts.append(data)
        total += len(data)
    return None
