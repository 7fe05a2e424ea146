"""Fixtures shared by the integration modules that recover children."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from settings import get_settings


@pytest.fixture
def local_presence(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """LOCAL client presence on the tests' Redis database."""
    from harness import events

    monkeypatch.setenv("REDIS_URL", redis_url)
    get_settings.cache_clear()
    events._redis.cache_clear()
    yield
    events._redis.cache_clear()
    get_settings.cache_clear()


@pytest.fixture
def short_timeout(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SUBAGENT_TIMEOUT_SECONDS", "2")
    monkeypatch.setenv("SUBAGENT_CANCEL_GRACE_SECONDS", "1")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()
