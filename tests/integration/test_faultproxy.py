"""The fault proxy (tests/faultproxy.py) against the real servers: psycopg2 to PostgreSQL, redis-py
to a private redis-server. Each fault is seen by the client as the driver's own error, and the
next connection through the proxy works."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg2
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.faultproxy import FaultProxy
from tests.helpers import wait_until
from tests.services import RedisServer, private_redis_fixture  # noqa: F401 - the private_redis fixture

pytestmark = pytest.mark.timeout(60)

TABLE = "faultproxy_probe"


@pytest.fixture
def pg_proxy(fresh_db_url: str) -> Iterator[tuple[FaultProxy, str]]:
    """A proxy in front of PostgreSQL, and a libpq URL of an empty database through it."""
    libpq_url = fresh_db_url.replace("+psycopg2", "")
    with psycopg2.connect(libpq_url) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {TABLE} (id int PRIMARY KEY)")
    conn.close()
    with FaultProxy.for_url(libpq_url) as proxy:
        yield proxy, proxy.rewrite(libpq_url)


def _count(url: str) -> int:
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT count(*) FROM {TABLE}")
            row = cur.fetchone()
            assert row is not None
            return int(row[0])
    finally:
        conn.close()


# --- PostgreSQL ---------------------------------------------------------------------------------


def test_a_cut_on_commit_fails_the_commit_and_the_transaction_is_rolled_back(pg_proxy: tuple[FaultProxy, str]) -> None:
    proxy, url = pg_proxy
    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute(f"INSERT INTO {TABLE} VALUES (1)")
    proxy.cut_on(b"COMMIT")
    with pytest.raises(psycopg2.OperationalError):
        conn.commit()
    assert conn.closed
    assert _count(url) == 0  # the next connection works; the server never saw the COMMIT
    stats = proxy.stats()
    assert (stats.cuts, stats.pattern_hits) == (1, 1)


def test_a_commit_delivered_before_the_cut_lands_although_the_client_gets_an_error(
    pg_proxy: tuple[FaultProxy, str],
) -> None:
    proxy, url = pg_proxy
    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute(f"INSERT INTO {TABLE} VALUES (1)")
    proxy.cut_on(b"COMMIT", when="after")
    with pytest.raises(psycopg2.OperationalError):
        conn.commit()
    # The ambiguous commit: the client saw a failure, the row is there.
    wait_until(lambda: _count(url) == 1, timeout=5, what="the delivered COMMIT to land")


def test_a_cut_on_an_insert_fails_that_statement_in_the_middle_of_a_transaction(
    pg_proxy: tuple[FaultProxy, str],
) -> None:
    proxy, url = pg_proxy
    proxy.cut_on(f"INSERT INTO {TABLE}".encode())
    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {TABLE}")  # the transaction is open
        with pytest.raises(psycopg2.OperationalError):
            cur.execute(f"INSERT INTO {TABLE} VALUES (1)")
    conn.close()
    assert _count(url) == 0
    assert proxy.stats().pattern_hits == 1


def test_a_frozen_connection_holds_the_statement_without_a_reset_and_a_thaw_lets_it_through(
    pg_proxy: tuple[FaultProxy, str],
) -> None:
    proxy, url = pg_proxy
    proxy.freeze_on(f"INSERT INTO {TABLE}".encode())
    conn = psycopg2.connect(url)
    outcome: list[object] = []

    def insert() -> None:
        try:
            with conn.cursor() as cur:
                cur.execute(f"INSERT INTO {TABLE} VALUES (1)")
            conn.commit()
            outcome.append("committed")
        except Exception as exc:
            outcome.append(exc)

    worker = threading.Thread(target=insert, daemon=True)
    worker.start()
    wait_until(lambda: proxy.stats().frozen == 1, timeout=5, what="the connection froze")
    worker.join(1.5)
    # Held, not failed: the client still waits, the connection is up, the server saw nothing.
    assert worker.is_alive() and outcome == [] and not conn.closed
    stats = proxy.stats()
    assert (stats.active, stats.cuts, stats.pattern_hits) == (1, 0, 1)
    assert _count(url) == 0
    assert proxy.thaw() == 1
    worker.join(5)
    assert outcome == ["committed"]
    assert _count(url) == 1
    conn.close()


def test_the_pattern_cut_fires_as_many_times_as_asked_then_disarms(pg_proxy: tuple[FaultProxy, str]) -> None:
    proxy, url = pg_proxy
    proxy.cut_on(f"INSERT INTO {TABLE}".encode(), times=2)
    for attempt in range(3):
        conn = psycopg2.connect(url)
        try:
            with conn.cursor() as cur:
                if attempt < 2:
                    with pytest.raises(psycopg2.OperationalError):
                        cur.execute(f"INSERT INTO {TABLE} VALUES ({attempt})")
                else:
                    cur.execute(f"INSERT INTO {TABLE} VALUES ({attempt})")
                    conn.commit()
        finally:
            conn.close()
    assert _count(url) == 1
    assert proxy.stats().cuts == 2


def test_cut_all_resets_every_open_connection_and_new_ones_work(pg_proxy: tuple[FaultProxy, str]) -> None:
    proxy, url = pg_proxy
    conns = [psycopg2.connect(url) for _ in range(2)]
    wait_until(lambda: proxy.stats().active == 2, timeout=5, what="two connections through the proxy")
    assert proxy.cut_all() == 2
    for conn in conns:
        with pytest.raises(psycopg2.OperationalError), conn.cursor() as cur:
            cur.execute("SELECT 1")
        conn.close()
    assert _count(url) == 0
    stats = proxy.stats()
    assert (stats.connections, stats.cuts) == (3, 2)


def test_refused_connections_fail_to_connect_until_the_window_ends(pg_proxy: tuple[FaultProxy, str]) -> None:
    proxy, url = pg_proxy
    proxy.refuse_for(1.0)
    with pytest.raises(psycopg2.OperationalError, match="refused"):
        psycopg2.connect(url, connect_timeout=2)
    wait_until(lambda: _probe_pg(url), timeout=10, interval=0.1, what="connections accepted again")


def test_refusing_can_also_cut_the_open_connections(pg_proxy: tuple[FaultProxy, str]) -> None:
    proxy, url = pg_proxy
    conn = psycopg2.connect(url)
    proxy.refuse_for(30.0, cut_open=True)
    with pytest.raises(psycopg2.OperationalError), conn.cursor() as cur:
        cur.execute("SELECT 1")
    conn.close()
    proxy.clear()  # listening again before the window ends
    assert _count(url) == 0


def test_each_connection_is_cut_the_given_ms_after_it_opens(pg_proxy: tuple[FaultProxy, str]) -> None:
    proxy, url = pg_proxy
    proxy.cut_after(300)
    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute("SELECT 1")  # alive at first
    wait_until(lambda: proxy.stats().cuts == 1, timeout=5, what="the timed cut")
    with pytest.raises(psycopg2.OperationalError), conn.cursor() as cur:
        cur.execute("SELECT 1")
    conn.close()
    proxy.cut_after(None)
    assert _count(url) == 0


def _probe_pg(url: str) -> bool:
    try:
        psycopg2.connect(url, connect_timeout=2).close()
    except psycopg2.OperationalError:
        return False
    return True


# --- Redis --------------------------------------------------------------------------------------


@pytest.fixture
def redis_proxy(private_redis: RedisServer) -> Iterator[tuple[FaultProxy, redis.Redis]]:
    """A proxy in front of a private redis-server, and a client through it that does not retry
    (redis-py retries a failed command on a new connection by default)."""
    with FaultProxy.for_url(private_redis.url) as proxy:
        client = redis.Redis(host="127.0.0.1", port=proxy.port, retry=Retry(NoBackoff(), 0), socket_timeout=5)
        yield proxy, client
        client.close()


def test_a_redis_command_cut_in_flight_fails_and_the_next_one_reconnects(
    redis_proxy: tuple[FaultProxy, redis.Redis],
) -> None:
    proxy, client = redis_proxy
    assert client.set("k", "1")
    proxy.cut_on(b"GET")
    with pytest.raises(redis.ConnectionError):
        client.get("k")
    assert client.get("k") == b"1"  # a new connection through the proxy
    assert (proxy.stats().connections, proxy.stats().cuts) == (2, 1)


def test_an_idle_redis_connection_cut_by_cut_all_is_replaced_at_checkout(
    redis_proxy: tuple[FaultProxy, redis.Redis],
) -> None:
    proxy, client = redis_proxy
    assert client.set("k", "1")
    assert proxy.cut_all() == 1
    # redis-py checks a pooled connection for a pending EOF/reset before use (like a pre-ping):
    # the reset idle connection is dropped and the command runs on a new one.
    assert client.get("k") == b"1"
    assert proxy.stats().connections == 2


def test_a_cut_on_exec_applies_nothing_of_the_redis_transaction(redis_proxy: tuple[FaultProxy, redis.Redis]) -> None:
    proxy, client = redis_proxy
    proxy.cut_on(b"EXEC")
    with pytest.raises(redis.ConnectionError):
        client.pipeline(transaction=True).set("a", "1").set("b", "2").execute()
    assert client.mget("a", "b") == [None, None]


def test_redis_refused_for_a_while_then_served(redis_proxy: tuple[FaultProxy, redis.Redis]) -> None:
    proxy, client = redis_proxy
    proxy.refuse_for(1.0)
    with pytest.raises(redis.ConnectionError):
        client.ping()
    wait_until(lambda: _probe_redis(client), timeout=10, interval=0.1, what="Redis through the proxy again")


def test_reset_mode_accepts_then_resets_and_counts_the_refusals(redis_proxy: tuple[FaultProxy, redis.Redis]) -> None:
    proxy, client = redis_proxy
    proxy.refuse_for(30.0, mode="reset")
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert proxy.stats().refused >= 1
    proxy.clear()
    assert client.ping()


def _probe_redis(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


# --- the proxy itself -----------------------------------------------------------------------------


def test_controls_from_many_threads_and_stop_are_safe(private_redis: RedisServer) -> None:
    proxy = FaultProxy.for_url(private_redis.url).start()
    with pytest.raises(RuntimeError):
        proxy.start()
    clients = [redis.Redis(port=proxy.port, retry=Retry(NoBackoff(), 0)) for _ in range(4)]
    barrier = threading.Barrier(len(clients))
    errors: list[BaseException] = []

    def use(client: redis.Redis) -> None:
        try:
            barrier.wait(5)
            for i in range(20):
                try:
                    client.incr("n")
                except redis.ConnectionError:
                    pass  # a neighbour's cut_all
                if i % 5 == 0:
                    proxy.cut_all()
                proxy.stats()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=use, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    stats = proxy.stats()
    assert stats.cuts >= 1 and stats.connections >= len(clients)
    proxy.stop()
    proxy.stop()  # idempotent
    with pytest.raises(redis.ConnectionError):
        clients[0].ping()
    for c in clients:
        c.close()
