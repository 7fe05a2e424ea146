"""fsbroker: the demo's filesystem:// broker publishes atomically. kombu's own transport creates
the message file under its final name before it writes it: a consumer polling then read an
empty file and its worker stopped ("Unrecoverable error: JSONDecodeError"), which once failed
the demo under a loaded test run."""

from __future__ import annotations

from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from kombu import Connection

import fsbroker

QUEUE = "celery"


def _connection(folder: Path) -> Any:
    options = {"data_folder_in": str(folder), "data_folder_out": str(folder), "store_processed": False}
    return Connection("filesystem://", transport="fsbroker:Transport", transport_options=options)


def test_a_consumer_polling_while_a_message_is_written_sees_nothing_then_the_whole_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen_mid_write: list[str] = []
    real_dumps = fsbroker.dumps
    with _connection(tmp_path) as publisher, _connection(tmp_path) as consumer:
        reader = consumer.default_channel

        def dumps_while_a_consumer_polls(payload: Any) -> str:
            try:  # the publisher is mid-write: a consumer polls the folder now
                seen_mid_write.append(repr(reader._get(QUEUE)))
            except Empty:
                seen_mid_write.append("empty")
            return str(real_dumps(payload))

        monkeypatch.setattr(fsbroker, "dumps", dumps_while_a_consumer_polls)
        publisher.default_channel._put(QUEUE, {"body": "whole"})
        monkeypatch.setattr(fsbroker, "dumps", real_dumps)
        assert seen_mid_write == ["empty"]  # kombu's own _put: JSONDecodeError here
        assert reader._get(QUEUE) == {"body": "whole"}
        with pytest.raises(Empty):
            reader._get(QUEUE)
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


def test_the_worker_uses_it_for_the_filesystem_broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import celeryconfig
    from settings import get_settings

    monkeypatch.setenv("CELERY_BROKER_URL", "filesystem://")
    monkeypatch.setenv("CELERY_FS_FOLDER", str(tmp_path))
    get_settings.cache_clear()
    try:
        conf = celeryconfig.build()
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    assert conf["broker_transport"] == "fsbroker:Transport"
    assert "broker_transport" not in celeryconfig.build()  # Redis (the default): kombu's own
