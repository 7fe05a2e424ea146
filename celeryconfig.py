"""Celery settings built from ``settings`` (DESIGN §2, CELERY-NOTES)."""

from __future__ import annotations

from typing import Any

from settings import get_settings


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
            # Field invocations and artifacts past retention_until, in batches (issue 10).
            "field-purge-expired": {"task": "field.purge_expired", "schedule": 3600.0},
        },
        "imports": ("tasks.signals", "tasks.queues", "tasks.agent", "tasks.recovery", "tasks.field"),
        # Scans, recoveries and deliveries never wait behind hour-long children (issue 9):
        # every worker serves both queues by default (`-Q celery,recovery`); a dedicated
        # recovery worker is `celery -A tasks worker -Q recovery` (Procfile).
        "task_routes": {
            "recovery.*": {"queue": s.RECOVERY_QUEUE},
            "agent.deliver_round": {"queue": s.RECOVERY_QUEUE},
        },
    }
    import brokerconfig

    # RabbitMQ: publisher confirms, quorum queues (README "RabbitMQ as the broker").
    conf.update(brokerconfig.options_for(s.CELERY_BROKER_URL))
    if s.CELERY_BROKER_URL.startswith("filesystem://"):
        conf["broker_transport_options"] = {
            "data_folder_in": s.CELERY_FS_FOLDER + "/out",
            "data_folder_out": s.CELERY_FS_FOLDER + "/out",
            "processed_folder": s.CELERY_FS_FOLDER + "/processed",
            "control_folder": s.CELERY_FS_FOLDER + "/control",
            "store_processed": False,
        }
    return conf
