"""Shared fixtures: a throwaway PostgreSQL database built by `alembic upgrade head`, Redis.

Tests that need PostgreSQL or Redis skip on a developer machine without them, and FAIL in CI
(CI=true): a missing service must never turn into a silent green run.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")
REDIS_BASE = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _missing(what: str, exc: BaseException) -> None:
    message = f"{what} is not reachable: {type(exc).__name__}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: services are required)", pytrace=False)
    pytest.skip(message)


def _admin_engine():  # type: ignore[no-untyped-def]
    from sqlalchemy import create_engine

    return create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """URL of a fresh database migrated to head; dropped at the end of the session."""
    from sqlalchemy import text

    name = f"ar_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        admin = _admin_engine()
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        _missing("PostgreSQL", exc)
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    os.environ["DATABASE_URL"] = url
    from settings import get_settings

    get_settings.cache_clear()
    from migrations import upgrade

    upgrade(url)
    yield url
    from models.db import dispose_engines

    dispose_engines()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


TABLES = ("message", "subagent_execution", "pending_round", "agent_session")


@pytest.fixture
def db(pg_url: str) -> Iterator[str]:
    """A clean database for one test (tables truncated before it)."""
    from sqlalchemy import text

    from models.db import get_engine

    engine = get_engine(pg_url)
    with engine.begin() as conn:
        existing = {
            r[0]
            for r in conn.execute(
                text("SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'alembic_version'")
            )
        }
        names = ", ".join(t for t in TABLES if t in existing)
        if names:
            conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
    yield pg_url


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis database reserved for tests, flushed before use."""
    import redis

    url = f"{REDIS_BASE}/13"
    try:
        client = redis.Redis.from_url(url)
        client.flushdb()
    except Exception as exc:
        _missing("Redis", exc)
    yield url
    client.close()


@pytest.fixture
def fresh_db_url() -> Iterator[str]:
    """An EMPTY database (no migrations run), for migration tests; dropped after the test."""
    from sqlalchemy import text

    name = f"ar_mig_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        admin = _admin_engine()
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        _missing("PostgreSQL", exc)
    yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    from models.db import dispose_engines

    dispose_engines()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()
