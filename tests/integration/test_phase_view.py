"""The external phase view never shows RESUMING (docs/state-machines.md): snapshots, lists, events, CLI."""

from __future__ import annotations

import json
import os
import time

import pytest

from cli.main import main as cli_main
from harness.events import CHANNEL, external_phase, publish_status
from harness.views import session_list, snapshot
from models import Phase, transaction
from tests.helpers import make_session


def test_external_phase_maps_resuming_to_running() -> None:
    assert external_phase(Phase.RESUMING) == "RUNNING"
    assert external_phase("RESUMING") == "RUNNING"
    assert external_phase(Phase.CANCELLED) == "CANCELLED"
    assert external_phase(None) is None


@pytest.mark.usefixtures("db")
def test_snapshot_list_and_cli_json_show_resuming_as_running(capsys: pytest.CaptureFixture[str]) -> None:
    sid = make_session(phase=Phase.RESUMING)
    with transaction() as s:
        assert snapshot(s, sid)["phase"] == "RUNNING"  # type: ignore[index]
        assert {r["phase"] for r in session_list(s)} == {"RUNNING"}
    assert cli_main(["session", "show", str(sid), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["phase"] == "RUNNING"
    assert set(shown) >= {"id", "phase", "messages", "executions"}
    assert cli_main(["session", "list", "--json"]) == 0
    assert "RESUMING" not in capsys.readouterr().out


def test_session_status_events_show_resuming_as_running(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import redis

    from harness import events
    from settings import get_settings

    monkeypatch.setenv("REDIS_URL", redis_url)
    get_settings.cache_clear()
    events._redis.cache_clear()
    client = redis.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    pubsub.subscribe(CHANNEL)
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    sid = 10**9 + os.getpid()  # Pub/Sub ignores database numbers: find OUR event among others
    publish_status(sid, Phase.RESUMING)
    event = None
    end = time.monotonic() + 5
    while event is None and time.monotonic() < end:
        message = pubsub.get_message(timeout=0.5)
        if message is not None and message["type"] == "message":
            candidate = json.loads(message["data"])
            if candidate.get("session_id") == sid:
                event = candidate
    assert event == {"type": "session_status", "session_id": sid, "phase": "RUNNING"}
    pubsub.close()
    client.close()
    events._redis.cache_clear()
    get_settings.cache_clear()
