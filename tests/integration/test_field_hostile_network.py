"""A hostile or misconfigured network (issue 18 items 1, 2 and 8): proxies from the environment,
a dripping CONNECT proxy, a slow resolver, black-holed addresses, descriptors of long calls.

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
from typing import Any

import pytest

from doubles.superagent import SuperAgentStub
from fieldrecovery.deadline import Deadline, Watchdog
from fieldrecovery.errors import DeadlineExceeded
from fieldrecovery.transport import watched_session
from tests.field_helpers import SampleCall, call_provider, open_api_client

KEY = "df_open_hostile_network_test"


class DrippingProxy:
    """An HTTP proxy on loopback that reads a request head, then drips a reply one byte at a time."""

    REPLY = b"HTTP/1.1 200 Connection established\r\nProxy-Agent: drip\r\nX-Pad: " + b"p" * 40 + b"\r\n\r\n"

    def __init__(self, drip_seconds: float = 0.25) -> None:
        self.drip_seconds = drip_seconds
        self.received = bytearray()
        self.connections = 0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> DrippingProxy:
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


# --- item 1: proxies -------------------------------------------------------------------------


def test_proxy_variables_and_netrc_of_the_environment_are_never_used(
    stub: SuperAgentStub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login intruder password from-netrc\n")
    netrc.chmod(0o600)
    with DrippingProxy() as proxy:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.setenv(name, proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.setenv("NETRC", str(netrc))
        started = time.monotonic()
        answer, _ = call_provider(open_api_client(stub.base_url, KEY), SampleCall(), seconds=1.5)
        elapsed = time.monotonic() - started
        assert proxy.connections == 0 and KEY.encode() not in proxy.received
    assert answer.content
    assert stub.bearer_tokens_seen == {KEY}  # never replaced by .netrc Basic auth
    assert elapsed < 1.5


def test_a_configured_proxy_that_drips_its_connect_reply_is_cut_at_the_deadline_and_never_sees_the_key(
    black_holes: list[tuple[str, int]],
) -> None:
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


# --- item 2: resolution and every address inside the deadline --------------------------------


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


# --- item 8: one descriptor per live connection, not per connection ever made ----------------


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


# --- item 1: a working CONNECT tunnel to a TLS platform, verified with the configured CA ------


class TunnellingProxy:
    """An HTTP CONNECT proxy on loopback that pipes bytes to ``routes[host:port]`` and records them."""

    def __init__(self, routes: dict[str, tuple[str, int]]) -> None:
        self.routes = routes
        self.received = bytearray()
        self.connects: list[bytes] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> TunnellingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

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

        def pipe(src: socket.socket, dst: socket.socket, record: bool) -> None:
            try:
                while data := src.recv(65536):
                    if record:
                        self.received += data
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pipe, args=(upstream, conn, False), daemon=True).start()
        pipe(conn, upstream, True)


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
