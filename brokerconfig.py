"""Broker-specific Celery options: what changes when the broker is RabbitMQ.

``celeryconfig.build()`` merges ``options_for(broker_url)`` last, so these override the Redis
defaults. Nothing here reads the environment (``settings`` does).

On RabbitMQ an unacked message is redelivered when the channel that holds it closes (worker
killed, connection lost): there is no visibility timeout. With ``task_acks_late`` a task stays
unacked while it runs, so the broker's ``consumer_timeout`` (default 30 min; a server setting
in ``rabbitmq.conf``, not a client option) must exceed the longest task — children may run
``SUBAGENT_TIMEOUT_SECONDS`` — or RabbitMQ closes the worker's channel mid-task and redelivers
everything it held. docs/operations.md, "RabbitMQ as the broker", gives the line to set.
"""

from __future__ import annotations

from typing import Any, Literal

QueueType = Literal["classic", "quorum"]

#: URL schemes served by kombu's AMQP transports.
AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://", "librabbitmq://")


def is_amqp(broker_url: str) -> bool:
    return broker_url.startswith(AMQP_SCHEMES)


def amqp_options(queue_type: QueueType = "quorum") -> dict[str, Any]:
    """Celery settings for a RabbitMQ broker.

    - ``confirm_publish``: ``apply_async`` returns once RabbitMQ has taken the message
      (publisher confirms), so a send that did not land raises in the sender instead of
      vanishing. It replaces the Redis-only ``visibility_timeout`` transport options.
    - Quorum queues (replicated, recommended): both the default queue and the queues created
      for routes (``recovery``) are declared with ``x-queue-type``; Celery detects them and
      uses per-consumer QoS, which quorum queues require. A queue's type cannot change once
      declared: switching an existing classic deployment means deleting its queues first.
    """
    return {
        "broker_transport_options": {"confirm_publish": True},
        "task_default_queue_type": queue_type,
        "task_create_missing_queue_type": queue_type,
        "worker_detect_quorum_queues": True,
    }


def options_for(broker_url: str, queue_type: QueueType = "quorum") -> dict[str, Any]:
    """The options to merge over the Redis defaults for ``broker_url``; empty when none apply."""
    return amqp_options(queue_type) if is_amqp(broker_url) else {}
