"""Private servers for fault tests: a ``redis-server`` of the test's own, on a free loopback port.

The shared Redis on 6379 serves every test run on the machine; a test that kills its broker
needs one nobody else uses. ``RedisServer`` runs without persistence (``--save ''``,
``--appendonly no``), so ``kill()`` then ``start()`` brings it back EMPTY on the same port: what
a production Redis without persistence looks like after a crash or a failover.

Use the ``private_redis`` fixture (import ``private_redis_fixture`` into the test module, or
list ``tests.services`` in ``pytest_plugins``), or ``RedisServer(dir).start()`` as a context
manager.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (the kernel's pick; another process may still take
    it before the caller binds, which on a test machine does not happen in practice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def redis_ping(host: str, port: int, timeout_seconds: float = 0.5) -> bool:
    """True when a Redis server answers PING on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_seconds) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` subprocess on ``port`` (a free one by default), its files and log
    in ``workdir``. ``kill()`` is a SIGKILL (nothing flushed, every client connection reset);
    ``start()`` again serves an empty Redis on the same port."""

    def __init__(self, workdir: Path, port: int | None = None, executable: str = "redis-server") -> None:
        self.workdir = Path(workdir)
        self.port = port if port is not None else free_port()
        self.executable = executable
        self.host = LOOPBACK
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        """Base URL without a database number: ``f"{server.url}/0"``."""
        return f"redis://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_seconds: float = 10.0) -> RedisServer:
        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--daemonize",
            "no",
        ]
        with open(self.workdir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        deadline = time.monotonic() + timeout_seconds
        while not redis_ping(self.host, self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited on start (port {self.port}):\n{self.log()[-2000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server not answering after {timeout_seconds:g}s:\n{self.log()[-2000:]}")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no goodbye to clients; the data is gone with the process."""
        if self.running:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self, down_seconds: float = 0.0) -> RedisServer:
        """kill -9, stay down ``down_seconds`` (the outage), start EMPTY on the same port."""
        self.kill()
        if down_seconds > 0:
            time.sleep(down_seconds)
        return self.start()

    def log(self) -> str:
        try:
            return (self.workdir / "redis.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> RedisServer:
        return self if self.running else self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def require_redis_server(executable: str = "redis-server") -> str:
    """The redis-server binary; skips the test without it on a developer machine, fails in CI."""
    path = shutil.which(executable)
    if path is None:
        message = f"{executable} is not installed"
        if IN_CI:
            pytest.fail(f"{message} (CI=true: services are required)", pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture(name="private_redis")
def private_redis_fixture(tmp_path: Path) -> Iterator[RedisServer]:
    """A running private ``redis-server`` for one test, stopped after it."""
    server = RedisServer(tmp_path / "redis", executable=require_redis_server())
    with server.start():
        yield server


# --- a private PgBouncer in transaction mode, in front of the test PostgreSQL -------------------


def require_pgbouncer(executable: str = "pgbouncer") -> str:
    """Debian's pgbouncer binary (``apt-get install pgbouncer``; .ci/run installs it); skips the
    test without it on a developer machine, fails in CI."""
    path = shutil.which(executable) or (f"/usr/sbin/{executable}" if Path(f"/usr/sbin/{executable}").exists() else None)
    if path is None:
        message = f"{executable} is not installed (apt-get install pgbouncer)"
        if IN_CI:
            pytest.fail(f"{message} (CI=true: services are required)", pytrace=False)
        pytest.skip(message)
    return path


def tcp_answers(host: str, port: int, timeout_seconds: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_seconds):
            return True
    except OSError:
        return False


class PgBouncer:
    """One ``pgbouncer`` subprocess of the test's own, on a free port, in ``pool_mode``
    (transaction by default), forwarding every database name to the PostgreSQL at
    ``server_host:server_port`` as ``server_user`` (``auth_type = any``: loopback tests only).
    Never the system's pgbouncer service. As root it runs as ``nobody`` (PgBouncer refuses
    root); its configuration and log live in ``workdir``."""

    def __init__(
        self,
        workdir: Path,
        *,
        server_host: str,
        server_port: int,
        server_user: str = "postgres",
        pool_mode: str = "transaction",
        pool_size: int = 20,
        executable: str = "pgbouncer",
    ) -> None:
        self.workdir = Path(workdir)
        self.port = free_port()
        self.host = LOOPBACK
        self.executable = executable
        self.proc: subprocess.Popen[bytes] | None = None
        self.config = self.workdir / "pgbouncer.ini"
        self.body = "\n".join(
            [
                "[databases]",
                f"* = host={server_host} port={server_port} user={server_user}",
                "[pgbouncer]",
                f"listen_addr = {self.host}",
                f"listen_port = {self.port}",
                "unix_socket_dir =",
                "auth_type = any",
                f"admin_users = {server_user}",
                f"pool_mode = {pool_mode}",
                f"default_pool_size = {pool_size}",
                "max_client_conn = 1000",
                "",
            ]
        )

    def url(self, database: str, user: str = "postgres") -> str:
        """A SQLAlchemy URL of ``database`` through this PgBouncer."""
        return f"postgresql+psycopg2://{user}@{self.host}:{self.port}/{database}"

    def start(self, timeout_seconds: float = 10.0) -> PgBouncer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir.chmod(0o755)
        self.config.write_text(self.body)
        self.config.chmod(0o644)
        cmd = [self.executable]
        if os.geteuid() == 0:
            cmd += ["-u", "nobody"]
        cmd.append(str(self.config))
        with open(self.workdir / "pgbouncer.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_seconds
        while not tcp_answers(self.host, self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited on start:\n{self.log()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pgbouncer not listening after {timeout_seconds:g}s:\n{self.log()[-2000:]}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def stats(self, database: str) -> dict[str, int]:
        """``SHOW STATS`` of ``database`` from PgBouncer's admin console (transactions and
        queries it forwarded)."""
        import psycopg2

        conn = psycopg2.connect(host=self.host, port=self.port, user="postgres", dbname="pgbouncer")
        conn.autocommit = True
        try:
            cur = conn.cursor()
            cur.execute("SHOW STATS")
            names = [d[0] for d in cur.description or ()]
            for row in cur.fetchall():
                found = dict(zip(names, row, strict=True))
                if found["database"] == database:
                    return {k: int(v) for k, v in found.items() if k != "database"}
        finally:
            conn.close()
        return {}

    def log(self) -> str:
        try:
            return (self.workdir / "pgbouncer.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
