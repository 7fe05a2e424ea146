"""Celery settings built from ``settings`` (docs/tasks.md: tasks, queues, routes, beat)."""

from __future__ import annotations

from typing import Any

from kombu import Exchange, Queue

from settings import get_settings

#: Celery's default queue: agent loops and children (long work).
DEFAULT_QUEUE = "celery"


def queues(recovery_queue: str, queue_type: str = "classic") -> tuple[Queue, ...]:
    """The declared queues: ``celery`` (agent loops, children, recovered children) and the
    recovery queue (scans, fan-out, deliveries, redeliveries: short work)."""
    arguments = {"x-queue-type": queue_type} if queue_type != "classic" else None
    return tuple(
        Queue(name, Exchange(name), routing_key=name, queue_arguments=arguments)
        for name in (DEFAULT_QUEUE, recovery_queue)
    )


def build() -> dict[str, Any]:
    s = get_settings()
    conf: dict[str, Any] = {
        "broker_url": s.CELERY_BROKER_URL,
        "result_backend": s.CELERY_RESULT_BACKEND,
        # At-least-once: a task is acked after it ran; a killed pool child requeues it.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_expires": 24 * 3600,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
        # Above the longest task (children may run an hour): a running task is not redelivered.
        "broker_transport_options": {"visibility_timeout": int(s.SUBAGENT_TIMEOUT_SECONDS + 2 * 3600)},
        "result_backend_transport_options": {"visibility_timeout": int(s.SUBAGENT_TIMEOUT_SECONDS + 2 * 3600)},
        "beat_schedule": {
            "recovery-scan": {"task": "recovery.scan", "schedule": s.SCAN_INTERVAL_SECONDS},
            # Field invocations and artifacts past retention_until, in batches.
            "field-purge-expired": {"task": "field.purge_expired", "schedule": 3600.0},
            # Decided approval requests past APPROVAL_RETENTION_DAYS, in batches.
            "approval-purge-decided": {"task": "approval.purge_decided", "schedule": 3600.0},
        },
        "imports": ("tasks.signals", "tasks.queues", "tasks.agent", "tasks.recovery", "tasks.field", "tasks.approval"),
        # Short work (scans, fan-out, deliveries, redeliveries) never waits behind hour-long
        # children: it has a queue of its own. A recovered child IS a child and
        # runs where children run (an exact name wins over the pattern in Celery's router).
        "task_default_queue": DEFAULT_QUEUE,
        "task_routes": {
            "recovery.recover_child": {"queue": DEFAULT_QUEUE},
            "recovery.recover_children": {"queue": DEFAULT_QUEUE},
            "recovery.*": {"queue": s.RECOVERY_QUEUE},
            "agent.deliver_round": {"queue": s.RECOVERY_QUEUE},
            "agent.deliver_rounds": {"queue": s.RECOVERY_QUEUE},
            "agent.approve": {"queue": s.RECOVERY_QUEUE},
            "agent.deny": {"queue": s.RECOVERY_QUEUE},
        },
    }
    import brokerconfig

    # RabbitMQ: publisher confirms, quorum queues (docs/operations.md, "RabbitMQ as the broker").
    conf.update(brokerconfig.options_for(s.CELERY_BROKER_URL))
    # Every queue a task is routed to is DECLARED, so a bare `celery -A tasks worker` consumes
    # them all (only declared queues are consumed by default); `-Q` still narrows a worker to some of them.
    conf["task_queues"] = queues(s.RECOVERY_QUEUE, conf.get("task_default_queue_type", "classic"))
    if s.CELERY_BROKER_URL.startswith("filesystem://"):
        conf["broker_transport"] = "fsbroker:Transport"  # kombu's, with atomic publishes
        conf["broker_transport_options"] = {
            "data_folder_in": s.CELERY_FS_FOLDER + "/out",
            "data_folder_out": s.CELERY_FS_FOLDER + "/out",
            "processed_folder": s.CELERY_FS_FOLDER + "/processed",
            "control_folder": s.CELERY_FS_FOLDER + "/control",
            "store_processed": False,
        }
    return conf
