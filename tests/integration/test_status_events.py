"""session_status events are sent by a thread of the process (harness.events): in order, never
waited for by the run that asks for them, bounded while Redis does not answer, and sent by a
forked child's own thread. Real Redis, and a TCP peer that accepts and never answers."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator

import pytest

from harness import events
from harness.events import CHANNEL, flush_status_events, publish_status
from models import Phase
from settings import get_settings


@pytest.fixture
def events_to(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Events sent to the REDIS_URL the test sets; the process's publisher is fresh before and
    after (nothing another test asked for is sent to this test's Redis, nor the reverse)."""
    flush_status_events(5)
    events._publisher.forget()
    yield monkeypatch
    flush_status_events(5)
    events._publisher.forget()
    get_settings.cache_clear()


@pytest.fixture
def silent_peer() -> Iterator[str]:
    """A redis:// URL of a TCP peer that takes connections and never answers (a frozen Redis)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    server.close()


def _received(pubsub: object, sid: int, n: int, timeout: float = 10) -> list[str]:
    phases: list[str] = []
    end = time.monotonic() + timeout
    while len(phases) < n and time.monotonic() < end:
        message = pubsub.get_message(timeout=0.5)  # type: ignore[attr-defined]
        if message is not None and message["type"] == "message":
            event = json.loads(message["data"])
            if event["session_id"] == sid:
                phases.append(event["phase"])
    return phases


def test_events_arrive_in_the_order_they_were_asked_for(redis_url: str, events_to: pytest.MonkeyPatch) -> None:
    import redis

    events_to.setenv("REDIS_URL", redis_url)
    get_settings.cache_clear()
    client = redis.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    pubsub.subscribe(CHANNEL)
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    sid = 2 * 10**9 + os.getpid()  # Pub/Sub ignores database numbers: find OUR events among others
    sequence = [Phase.RUNNING, Phase.WAITING_USER, Phase.RESUMING, Phase.COMPLETED] * 25
    for phase in sequence:
        publish_status(sid, phase)
    assert flush_status_events(10)
    assert _received(pubsub, sid, len(sequence)) == [events.external_phase(p) for p in sequence]
    pubsub.close()
    client.close()


def test_a_run_never_waits_for_a_redis_that_does_not_answer_and_the_backlog_is_bounded(
    silent_peer: str, events_to: pytest.MonkeyPatch
) -> None:
    events_to.setenv("REDIS_URL", silent_peer)
    events_to.setattr(events, "MAX_WAITING", 5)
    get_settings.cache_clear()
    publish_status(1, Phase.RUNNING)
    # The call returned while its event was still unsent: the thread waits for the peer, not the run.
    assert flush_status_events(0.05) is False
    for sid in range(2, 40):
        publish_status(sid, Phase.RUNNING)
    assert events._publisher.dropped >= 30  # at most MAX_WAITING wait; the rest are counted
    # The peer never answers: each batch fails after the client's socket timeout, the events are lost.
    assert flush_status_events(10)


def test_a_forked_child_sends_its_own_events_with_a_thread_of_its_own(
    redis_url: str, events_to: pytest.MonkeyPatch
) -> None:
    import redis

    events_to.setenv("REDIS_URL", redis_url)
    get_settings.cache_clear()
    client = redis.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    pubsub.subscribe(CHANNEL)
    pubsub.get_message(timeout=1)
    sid = 3 * 10**9 + os.getpid()
    publish_status(sid, Phase.RUNNING)  # the parent's thread exists before the fork
    assert flush_status_events(10)
    pid = os.fork()
    if pid == 0:  # the child: its own thread sends (the parent's is not there)
        publish_status(sid, Phase.COMPLETED)
        os._exit(0 if flush_status_events(10) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _received(pubsub, sid, 2) == ["RUNNING", "COMPLETED"]
    pubsub.close()
    client.close()
