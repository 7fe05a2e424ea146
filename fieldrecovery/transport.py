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

Nothing comes from the environment (``trust_env = False``): ``HTTPS_PROXY``/``HTTP_PROXY``/
``NO_PROXY``, ``REQUESTS_CA_BUNDLE``/``CURL_CA_BUNDLE`` and ``.netrc`` are ignored, so the Bearer
key goes to the platform only, never to a proxy in clear nor replaced by Basic auth. A proxy is
used only when ``open_api.proxy`` names one, and only for an ``https://`` platform: an HTTP
CONNECT tunnel, the key inside TLS end to end. The proxy's socket is made by the same watched
connection class, so a proxy that drips its CONNECT reply is cut at the deadline like the
platform. ``open_api.ca_bundle`` names the CA certificates to verify the platform with (default:
certifi's bundle).

Connecting is ours too (``connect_within``): the name is resolved by ``resolver`` (default
``socket.getaddrinfo``) in a helper thread that the caller waits for only until the deadline,
and each address gets the connect timeout capped at the time left, so neither a slow resolver
nor a list of black-holed addresses can run past the deadline.
"""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Callable, Sequence
from http.cookiejar import Cookie, DefaultCookiePolicy
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError

from fieldrecovery.deadline import Deadline, Watchdog

#: The double-submit cookie name; the header is X-CSRF-Token.
CSRF_COOKIE = "csrf_token"


class _NoCsrfCookiePolicy(DefaultCookiePolicy):
    """Store what servers set, except a csrf_token: ours is the only one we ever send."""

    def set_ok(self, cookie: Cookie, request: Any) -> bool:
        return cookie.name != CSRF_COOKIE and bool(super().set_ok(cookie, request))


#: ``resolver(host, port)`` -> ``socket.getaddrinfo``-shaped entries (family, type, proto, name, sockaddr).
Resolver = Callable[[str, int], Sequence[tuple[Any, ...]]]


def system_resolver(host: str, port: int) -> Sequence[tuple[Any, ...]]:
    return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)


def resolve_within(resolver: Resolver, host: str, port: int, deadline: Deadline) -> Sequence[tuple[Any, ...]]:
    """``resolver(host, port)``, waited for until the deadline (TimeoutError after it).

    NOTE: getaddrinfo cannot be interrupted; a resolver still running at the deadline is left to
    finish in its daemon thread, and its answer is dropped.
    """
    result: list[Sequence[tuple[Any, ...]]] = []
    error: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            result.append(resolver(host, port))
        except BaseException as exc:  # handed to the caller's thread
            error.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="field-resolver", daemon=True).start()
    if not done.wait(deadline.remaining()):
        raise TimeoutError("name resolution did not finish before the deadline")
    if error:
        raise error[0]
    return result[0]


def connect_within(
    host: str,
    port: int,
    *,
    timeout: float | None,
    deadline: Deadline,
    resolver: Resolver,
    socket_options: Sequence[tuple[int, int, int | bytes]] | None = None,
) -> socket.socket:
    """A socket connected to the first address of ``host`` that answers, before the deadline.

    Each address gets ``timeout`` capped at the time left; TimeoutError when the deadline passes
    (while resolving or connecting), else the last address's OSError.
    """
    last: OSError | None = None
    for family, type_, proto, _, sockaddr in resolve_within(resolver, host, port, deadline):
        left = deadline.remaining()
        if left <= 0:
            raise TimeoutError("the deadline passed while connecting")
        try:
            sock = socket.socket(family, type_, proto)
        except OSError as exc:  # an address family this host cannot use (IPv6 disabled)
            last = exc
            continue
        try:
            for option in socket_options or ():
                sock.setsockopt(*option)
            sock.settimeout(left if timeout is None else min(timeout, left))
            sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        return sock
    if deadline.expired:
        raise TimeoutError("the deadline passed while connecting")
    raise last or OSError(f"no address for {host}")


#: Informational (1xx) replies skipped before one response; more is a peer that never answers.
MAX_INFORMATIONAL_REPLIES = 32


class FinalResponse(http.client.HTTPResponse):
    """An http.client response that skips EVERY informational reply (102 Processing, 103 Early
    Hints …), not only 100 Continue: the response is the first final (or 101) status.

    More than MAX_INFORMATIONAL_REPLIES in a row is an HTTPException (a ``bad_response``); each
    one's headers are read with http.client's own limits (count and line length).
    """

    def _read_status(self) -> tuple[str, int, str]:
        skipped = 0
        while True:
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 102 <= status < 200:
                return version, status, reason
            skipped += 1
            if skipped > MAX_INFORMATIONAL_REPLIES:
                raise http.client.HTTPException("too many informational replies")
            http.client._read_headers(self.fp)  # type: ignore[attr-defined]


def _pool_classes(watchdog: Watchdog, resolver: Resolver) -> dict[str, type[HTTPConnectionPool]]:
    def new_conn(conn: HTTPConnection) -> socket.socket:
        try:
            sock = connect_within(
                conn._dns_host,  # the proxy's host when tunnelling
                conn.port,
                timeout=conn.timeout if isinstance(conn.timeout, int | float) else None,
                deadline=watchdog.deadline,
                resolver=resolver,
                socket_options=conn.socket_options,
            )
        except socket.gaierror as exc:
            raise NameResolutionError(conn.host, conn, exc) from exc
        except TimeoutError as exc:
            raise ConnectTimeoutError(conn, f"Connection to {conn.host} timed out") from exc
        except OSError as exc:
            raise NewConnectionError(conn, f"Failed to establish a new connection: {exc}") from exc
        watchdog.watch_socket(sock, owner=conn)
        return sock

    class WatchedHTTPConnection(HTTPConnection):
        response_class = FinalResponse

        def _new_conn(self) -> socket.socket:
            return new_conn(self)

    class WatchedHTTPSConnection(HTTPSConnection):
        response_class = FinalResponse

        def _new_conn(self) -> socket.socket:
            return new_conn(self)

    class WatchedHTTPConnectionPool(HTTPConnectionPool):
        ConnectionCls = WatchedHTTPConnection

    class WatchedHTTPSConnectionPool(HTTPSConnectionPool):
        ConnectionCls = WatchedHTTPSConnection

    return {"http": WatchedHTTPConnectionPool, "https": WatchedHTTPSConnectionPool}


class _WatchedAdapter(HTTPAdapter):
    def __init__(self, watchdog: Watchdog, resolver: Resolver) -> None:
        self._pools = _pool_classes(watchdog, resolver)
        super().__init__(pool_connections=1, pool_maxsize=2, max_retries=0)

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any) -> None:
        super().init_poolmanager(connections, maxsize, block=block, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = self._pools

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        """The configured proxy's manager, with the same watched connections (settings refuse socks)."""
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        manager.pool_classes_by_scheme = self._pools
        return manager


def watched_session(
    watchdog: Watchdog, *, proxy: str = "", ca_bundle: str = "", resolver: Resolver | None = None
) -> requests.Session:
    """A Session for ONE call: its sockets are the watchdog's to cut; no csrf_token is stored.

    Nothing is taken from the environment (module doc); ``proxy`` (an ``http://`` CONNECT
    proxy) is used for ``https://`` requests only; ``ca_bundle`` replaces certifi's bundle.
    """
    http = requests.Session()
    http.trust_env = False
    adapter = _WatchedAdapter(watchdog, resolver or system_resolver)
    http.mount("http://", adapter)
    http.mount("https://", adapter)
    http.cookies.set_policy(_NoCsrfCookiePolicy())
    http.proxies = {"https": proxy} if proxy else {}
    http.verify = ca_bundle or True
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
