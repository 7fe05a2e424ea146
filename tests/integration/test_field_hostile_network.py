"""A hostile or misconfigured network: proxies and .netrc from the
environment (the call and its cancel), a dripping CONNECT proxy (its reply, or the platform's
bytes through the tunnel), a slow resolver, black-holed addresses, descriptors of long calls.

Every peer is a real loopback server started here: a proxy that drips its reply one byte at a
time and records what it was sent, listeners whose accept queue is full (a connect to them
hangs, as to a black-holed address), the SuperAgent stand-in. The resolver is a function handed
to the client (``OpenApiClient(resolver=...)``), not a patch of the OS.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Self

import pytest

from doubles.superagent import Behaviour, SuperAgentStub
from fieldrecovery.client import CallProgress
from fieldrecovery.deadline import Deadline, Watchdog
from fieldrecovery.errors import DeadlineExceeded
from fieldrecovery.transport import watched_session
from tests.field_helpers import SampleCall, call_provider, open_api_client

KEY = "df_open_hostile_network_test"


class LoopbackProxy:
    """What the proxies below share: a listener on loopback, a thread that accepts, one thread
    per connection running ``_handle``, and every byte the proxy was sent in ``received``."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.connections = 0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        raise NotImplementedError


class DrippingProxy(LoopbackProxy):
    """An HTTP proxy on loopback that reads a request head, then drips a reply one byte at a time."""

    REPLY = b"HTTP/1.1 200 Connection established\r\nProxy-Agent: drip\r\nX-Pad: " + b"p" * 40 + b"\r\n\r\n"

    def __init__(self, drip_seconds: float = 0.25) -> None:
        super().__init__()
        self.drip_seconds = drip_seconds

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                while b"\r\n\r\n" not in self.received:
                    data = conn.recv(65536)
                    if not data:
                        return
                    self.received += data
                for i in range(len(self.REPLY)):
                    if self._stop.wait(self.drip_seconds):
                        return
                    conn.sendall(self.REPLY[i : i + 1])
            except OSError:
                return


class ForwardingProxy(LoopbackProxy):
    """A plain HTTP proxy on loopback: each connection's absolute-form requests go to the host
    its first request line names; records the request lines and every byte it was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.request_lines: list[bytes] = []

    def _handle(self, conn: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            while data := conn.recv(65536):
                self.received += data
                for line in data.split(b"\r\n"):
                    if line.split(b" ", 1)[0] in (b"GET", b"POST", b"CONNECT"):
                        self.request_lines.append(line)
                if upstream is None:
                    host_port = data.split(b" ", 2)[1].split(b"/")[2].decode()
                    host, _, port = host_port.partition(":")
                    upstream = socket.create_connection((host, int(port or 80)))
                    threading.Thread(target=_pipe, args=(upstream, conn), daemon=True).start()
                upstream.sendall(data)
        except (OSError, IndexError, ValueError):
            pass
        finally:
            for s in (conn, upstream):
                if s is not None:
                    s.close()


def _pipe(src: socket.socket, dst: socket.socket, drip_seconds: float = 0.0) -> None:
    """Copy ``src`` to ``dst`` until either side closes; one byte per ``drip_seconds`` if set."""
    try:
        while data := src.recv(1 if drip_seconds else 65536):
            if drip_seconds:
                time.sleep(drip_seconds)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def stub() -> Iterator[SuperAgentStub]:
    with SuperAgentStub(api_key=KEY) as server:
        yield server


@pytest.fixture
def black_holes() -> Iterator[list[tuple[str, int]]]:
    """Four loopback listeners whose accept queue is full: a connect to them hangs."""
    listeners, fillers = [], []
    for _ in range(4):
        listener = socket.create_server(("127.0.0.1", 0), backlog=0)
        listeners.append(listener)
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            try:
                filler.connect(listener.getsockname())
            except BlockingIOError:
                pass
            fillers.append(filler)
    time.sleep(0.2)
    yield [s.getsockname()[:2] for s in listeners]
    for s in fillers + listeners:
        s.close()


def _addresses(pairs: Sequence[tuple[str, int]]) -> list[tuple[Any, ...]]:
    return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", pair) for pair in pairs]


# --- proxies -------------------------------------------------------------------------


def test_proxy_variables_of_the_environment_are_never_used(
    stub: SuperAgentStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    with DrippingProxy() as proxy:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.setenv(name, proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        started = time.monotonic()
        answer, _ = call_provider(open_api_client(stub.base_url, KEY), SampleCall(), seconds=1.5)
        elapsed = time.monotonic() - started
        assert proxy.connections == 0 and KEY.encode() not in proxy.received
    assert answer.content
    assert elapsed < 1.5


def test_netrc_of_the_environment_never_replaces_the_bearer_key(
    stub: SuperAgentStub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login intruder password from-netrc\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    answer, _ = call_provider(open_api_client(stub.base_url, KEY), SampleCall(), seconds=5)
    assert answer.content
    assert stub.bearer_tokens_seen == {KEY}  # every request carried the Bearer key, none Basic auth


def test_the_run_cancel_after_a_deadline_never_goes_to_a_proxy_of_the_environment(
    stub: SuperAgentStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A working HTTP proxy in the environment (it forwards to the stand-in): a client that used
    # it would send the cancel, Bearer key in clear, through it.
    stub.configure(behaviour=Behaviour.SLOW, stall_seconds=10)
    with ForwardingProxy() as proxy:
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        progress = CallProgress()
        with pytest.raises(DeadlineExceeded):
            call_provider(open_api_client(stub.base_url, KEY), SampleCall(), seconds=1.0, progress=progress)
        assert progress.cancel_sent and stub.cancelled_runs, "the run was not cancelled"
        assert proxy.request_lines == [], f"through the proxy: {proxy.request_lines}"
        assert KEY.encode() not in proxy.received


def test_a_configured_proxy_that_drips_its_connect_reply_is_cut_at_the_deadline_and_never_sees_the_key() -> None:
    with DrippingProxy() as proxy:
        client = open_api_client("https://platform.test", KEY, proxy=proxy.url, connect_timeout=1.2)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            call_provider(client, SampleCall(), seconds=1.5)
        elapsed = time.monotonic() - started
        assert proxy.received.startswith(b"CONNECT platform.test:443 HTTP/1.")
        assert KEY.encode() not in proxy.received
    assert elapsed < 2.2, f"{elapsed:.1f}s against a 1.5s deadline"


def test_a_proxy_is_refused_for_an_http_base_url_where_the_key_would_travel_in_clear() -> None:
    with pytest.raises(ValueError, match="PROXY needs an https"):
        open_api_client("http://127.0.0.1:8080", KEY, proxy="http://127.0.0.1:3128")


# --- resolution and every address inside the deadline --------------------------------


def test_four_black_holed_addresses_end_at_the_deadline_not_after_four_connect_timeouts(
    black_holes: list[tuple[str, int]],
) -> None:
    calls: list[str] = []

    def resolver(host: str, port: int) -> list[tuple[Any, ...]]:
        calls.append(host)
        return _addresses(black_holes)

    client = open_api_client("https://platform.test", KEY, connect_timeout=1.2, resolver=resolver)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        call_provider(client, SampleCall(), seconds=1.5)
    elapsed = time.monotonic() - started
    assert calls and calls[0] == "platform.test"
    assert elapsed < 2.2, f"{elapsed:.1f}s against a 1.5s deadline"


def test_a_resolver_that_never_answers_ends_at_the_deadline() -> None:
    release = threading.Event()

    def resolver(host: str, port: int) -> list[tuple[Any, ...]]:
        release.wait(30)
        return []

    client = open_api_client("https://platform.test", KEY, resolver=resolver)
    started = time.monotonic()
    try:
        with pytest.raises(DeadlineExceeded):
            call_provider(client, SampleCall(), seconds=1.0)
    finally:
        release.set()
    assert time.monotonic() - started < 1.7


def test_the_resolver_names_the_address_the_client_connects_to(stub: SuperAgentStub) -> None:
    port = int(stub.base_url.rsplit(":", 1)[1])
    seen: list[tuple[str, int]] = []

    def resolver(host: str, asked_port: int) -> list[tuple[Any, ...]]:
        seen.append((host, asked_port))
        return _addresses([("127.0.0.1", port)])

    client = open_api_client(f"http://localhost:{port}", KEY, resolver=resolver)
    answer, _ = call_provider(client, SampleCall())
    assert answer.content and seen[0] == ("localhost", port)


def test_a_refused_first_address_falls_through_to_the_next_one(stub: SuperAgentStub) -> None:
    closed = socket.create_server(("127.0.0.1", 0))
    refused = closed.getsockname()[:2]
    closed.close()  # nothing listens there any more: the connect is refused at once

    def resolver(host: str, port: int) -> list[tuple[Any, ...]]:
        return _addresses([refused, ("127.0.0.1", stub.port)])

    client = open_api_client(f"http://localhost:{stub.port}", KEY, resolver=resolver)
    answer, _ = call_provider(client, SampleCall())
    assert answer.content


# --- one descriptor per live connection, not per connection ever made ----------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_long_call_holds_descriptors_for_its_live_connections_only(stub: SuperAgentStub) -> None:
    with Watchdog(Deadline(30)) as watchdog, watched_session(watchdog) as http:
        http.get(stub.base_url + "/_stats", timeout=5).close()
        http.close()  # the pool's connection is closed; the next request opens a new one
        before = _open_fds()
        for _ in range(40):
            http.get(stub.base_url + "/_stats", timeout=5).close()
            http.close()
        grown = _open_fds() - before
    assert grown <= 3, f"{grown} descriptors kept for 40 closed connections"


# --- a working CONNECT tunnel to a TLS platform, verified with the configured CA ------


class TunnellingProxy(LoopbackProxy):
    """An HTTP CONNECT proxy on loopback that pipes bytes to ``routes[host:port]`` and records them."""

    def __init__(self, routes: dict[str, tuple[str, int]], drip_seconds: float = 0.0) -> None:
        super().__init__()
        self.routes = routes
        #: > 0: what the platform sends reaches the client one byte per this many seconds.
        self.drip_seconds = drip_seconds
        self.connects: list[bytes] = []

    def _handle(self, conn: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = conn.recv(65536)
            if not data:
                conn.close()
                return
            head += data
        line = head.split(b"\r\n", 1)[0]
        self.connects.append(line)
        target = self.routes.get(line.split(b" ")[1].decode())
        if not line.startswith(b"CONNECT ") or target is None:
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            conn.close()
            return
        upstream = socket.create_connection(target)
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")

        threading.Thread(target=_pipe, args=(upstream, conn, self.drip_seconds), daemon=True).start()
        try:
            while data := conn.recv(65536):
                self.received += data
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            for s in (conn, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture(scope="module")
def platform_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for platform.test, made by the openssl command line."""
    import subprocess

    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    command = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
    command += ["-days", "2", "-subj", "/CN=platform.test", "-addext", "subjectAltName=DNS:platform.test"]
    subprocess.run(
        command,
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


@pytest.fixture
def tls_stub(platform_cert: tuple[Path, Path]) -> Iterator[SuperAgentStub]:
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(platform_cert[0]), str(platform_cert[1]))
    with SuperAgentStub(api_key=KEY, ssl_context=context) as server:
        yield server


def test_a_configured_connect_proxy_reaches_a_tls_platform_verified_with_the_configured_ca_bundle(
    tls_stub: SuperAgentStub, platform_cert: tuple[Path, Path]
) -> None:
    base = f"https://platform.test:{tls_stub.port}"
    with TunnellingProxy({f"platform.test:{tls_stub.port}": ("127.0.0.1", tls_stub.port)}) as proxy:
        client = open_api_client(base, KEY, proxy=proxy.url, ca_bundle=str(platform_cert[0]))
        answer, progress = call_provider(client, SampleCall(), seconds=10)
        assert answer.content and progress.run_id
        assert proxy.connects and all(c.startswith(b"CONNECT platform.test:") for c in proxy.connects)
        assert KEY.encode() not in proxy.received  # only TLS records went through the proxy
    assert tls_stub.bearer_tokens_seen == {KEY}


def test_requests_ca_bundle_of_the_environment_is_not_trusted(
    tls_stub: SuperAgentStub, platform_cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fieldrecovery.errors import ProviderUnavailable

    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(platform_cert[0]))
    monkeypatch.setenv("CURL_CA_BUNDLE", str(platform_cert[0]))
    base = f"https://platform.test:{tls_stub.port}"
    with TunnellingProxy({f"platform.test:{tls_stub.port}": ("127.0.0.1", tls_stub.port)}) as proxy:
        client = open_api_client(base, KEY, proxy=proxy.url)
        with pytest.raises(ProviderUnavailable) as info:
            call_provider(client, SampleCall(), seconds=10)
    assert info.value.code == "tls"
    assert tls_stub.bearer_tokens_seen == set()


def test_a_configured_proxy_that_drips_what_the_platform_sends_is_cut_at_the_deadline(
    tls_stub: SuperAgentStub, platform_cert: tuple[Path, Path]
) -> None:
    # The CONNECT reply comes at once; then every byte from the platform (TLS handshake, status
    # line, headers) one per 50 ms. The connect timeout (which also bounds the TLS handshake) is
    # far above the deadline: only the watchdog on the tunnelled socket can stop the call in time.
    base = f"https://platform.test:{tls_stub.port}"
    routes = {f"platform.test:{tls_stub.port}": ("127.0.0.1", tls_stub.port)}
    with TunnellingProxy(routes, drip_seconds=0.05) as proxy:
        client = open_api_client(base, KEY, proxy=proxy.url, ca_bundle=str(platform_cert[0]), connect_timeout=10)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            call_provider(client, SampleCall(), seconds=1.5)
        elapsed = time.monotonic() - started
        assert proxy.connects, "the proxy was never asked"
    assert elapsed < 2.2, f"{elapsed:.1f}s against a 1.5s deadline"
