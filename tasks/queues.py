"""How many messages each queue holds and how long the oldest has waited (`agent-recovery
status`, health).

Every message carries a ``sent_at`` header (set at publish below). On the Redis transport a
queue is a list whose oldest message is its tail, so the wait is read without consuming;
RabbitMQ cannot be peeked without consuming: there only the depth is reported, read by a
passive ``queue_declare``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from celery.signals import before_task_publish

from settings import get_settings


@before_task_publish.connect
def _stamp(headers: dict[str, Any] | None = None, **_: object) -> None:
    if headers is not None:
        headers.setdefault("sent_at", time.time())


def queue_waits(queues: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    settings = get_settings()
    queues = queues or ("celery", settings.RECOVERY_QUEUE)
    url = settings.CELERY_BROKER_URL
    out: list[dict[str, Any]] = []
    if url.startswith(("amqp", "pyamqp")):
        return [{"queue": q, "messages": depth, "oldest_wait_seconds": None} for q, depth in amqp_depths(url, queues)]
    if not url.startswith("redis"):
        return [{"queue": q, "messages": None, "oldest_wait_seconds": None} for q in queues]
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        for q in queues:
            depth = int(client.llen(q))
            oldest = client.lindex(q, -1) if depth else None
            wait = None
            if oldest is not None:
                try:
                    sent = json.loads(oldest)["headers"].get("sent_at")
                    wait = None if sent is None else round(max(0.0, time.time() - float(sent)), 1)
                except (ValueError, KeyError, TypeError):
                    wait = None
            out.append({"queue": q, "messages": depth, "oldest_wait_seconds": wait})
    except redis.RedisError:
        return [{"queue": q, "messages": None, "oldest_wait_seconds": None} for q in queues]
    finally:
        client.close()
    return out


def amqp_depths(url: str, queues: tuple[str, ...]) -> list[tuple[str, int | None]]:
    """Each queue's ready messages on RabbitMQ, by a passive ``queue_declare`` (it creates
    nothing and consumes nothing); None for a queue that does not exist, or for all when the
    broker cannot be reached within a couple of seconds."""
    from kombu import Connection
    from kombu.exceptions import OperationalError

    out: list[tuple[str, int | None]] = []
    try:
        with Connection(url, connect_timeout=2) as conn:
            channel = conn.channel()
            for q in queues:
                try:
                    out.append((q, int(channel.queue_declare(queue=q, passive=True).message_count)))
                except conn.channel_errors:  # no such queue: the broker closed the channel
                    out.append((q, None))
                    channel = conn.channel()
    except (OperationalError, *_connection_errors()):
        return [(q, None) for q in queues]
    return out


def _connection_errors() -> tuple[type[BaseException], ...]:
    import socket

    try:
        import amqp.exceptions

        return (OSError, socket.timeout, amqp.exceptions.AMQPError)
    except ImportError:
        return (OSError, socket.timeout)
