"""brokerconfig: what changes for Celery when the broker is RabbitMQ."""

from __future__ import annotations

import pytest

from brokerconfig import amqp_options, is_amqp, options_for


@pytest.mark.parametrize(
    "url", ["amqp://guest:guest@127.0.0.1:5672//", "amqps://u:p@mq.example:5671/vh", "pyamqp://127.0.0.1//"]
)
def test_an_amqp_url_gets_publisher_confirms_and_quorum_queues(url: str) -> None:
    assert is_amqp(url)
    options = options_for(url)
    assert options["broker_transport_options"] == {"confirm_publish": True}  # no Redis visibility_timeout
    assert options["task_default_queue_type"] == options["task_create_missing_queue_type"] == "quorum"
    assert options["worker_detect_quorum_queues"] is True


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "filesystem://", "rediss://h:6380/0"])
def test_other_brokers_get_nothing(url: str) -> None:
    assert not is_amqp(url)
    assert options_for(url) == {}


def test_classic_queues_can_be_kept_for_an_existing_deployment() -> None:
    options = amqp_options("classic")
    assert options["task_default_queue_type"] == options["task_create_missing_queue_type"] == "classic"
