"""Telling people a request waits (real PostgreSQL, a scripted model and a webhook receiver on
loopback HTTP): the ``approval_requested`` signal after the request's commit, the webhook's
signed POST without the call's arguments, retried with back-off and a bound, and recorded; a
notification that fails never blocks the approval."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from crashpoints import InjectedFault, armed_fault
from doubles.webhook_receiver import WebhookReceiver
from harness.approval_notify import approval_requested, deliver, payload
from harness.parent import run_agent
from harness.views import create_session
from models import ApprovalStatus, Phase
from models.approval import Requested
from tests.helpers import RecordingScheduler, loop_deps, phase_of
from tests.integration.test_approvals import Runs, approve, call, parent_script, requests, settle
from tests.integration.test_approvals import runs as runs  # the fixture
from tests.types import ModelFactory

SECRET = "webhook-secret-for-tests"


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch) -> Iterator[WebhookReceiver]:
    """A receiver that checks the signature under SECRET; APPROVAL_WEBHOOK_URL names it."""
    from settings import get_settings

    with WebhookReceiver(secret=SECRET) as receiver:
        monkeypatch.setenv("APPROVAL_WEBHOOK_URL", receiver.url)
        monkeypatch.setenv("APPROVAL_WEBHOOK_SECRET", SECRET)
        get_settings.cache_clear()
        yield receiver
    monkeypatch.undo()
    get_settings.cache_clear()


@pytest.fixture
def announced() -> Iterator[list[Requested]]:
    """Every request the ``approval_requested`` signal announced in this test (an in-process
    handler, as an application connects one)."""
    got: list[Requested] = []

    def handler(sender: Any = None, request: Requested | None = None, **_: Any) -> None:
        assert request is not None
        got.append(request)

    approval_requested.connect(handler, weak=False)
    yield got
    approval_requested.disconnect(handler)


def parked(model_factory: ModelFactory) -> tuple[int, Any]:
    model = model_factory(parent_script(call("refund", order="SECRET-ORDER-9", amount=30)))
    deps = loop_deps(model.base_url, RecordingScheduler())
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "waiting_approval"
    return sid, deps


def test_a_new_request_is_announced_after_its_commit_and_posted_signed_without_arguments_retried_after_failures(
    model_factory: ModelFactory, runs: Runs, hook: WebhookReceiver, announced: list[Requested]
) -> None:
    from tasks.approval import notify_task

    hook.fail_first = 2
    sid, _ = parked(model_factory)
    (req,) = requests()
    (r,) = announced
    assert (r.id, r.session_id, r.call_id, r.tool, r.expires_at) == (req.id, sid, req.call_id, "refund", req.expires_at)
    done = notify_task.apply(args=[payload(r)])  # eager: each retry runs at once
    assert done.successful() and done.result == {"notified": True}
    assert [s.status for s in hook.seen] == [503, 503, 204]
    assert all(s.signed for s in hook.seen)
    (body,) = hook.accepted
    assert body == {
        "event": "approval.requested",
        "id": req.id,
        "session_id": sid,
        "call_id": req.call_id,
        "tool": "refund",
        "agent_type": "main",
        "requested_at": body["requested_at"],
        "expires_at": req.expires_at.isoformat(),
    }
    assert "SECRET-ORDER-9" not in json.dumps(body) and "arguments" not in body
    (req,) = requests()
    assert req.notified_at is not None


def test_the_signal_runs_the_webhook_task_and_a_wrong_secret_is_retried_to_its_bound_without_blocking_the_approval(
    model_factory: ModelFactory, runs: Runs, hook: WebhookReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from settings import get_settings
    from tasks import app
    from tasks.approval import WEBHOOK_MAX_RETRIES

    monkeypatch.setenv("APPROVAL_WEBHOOK_SECRET", "not-the-receivers-secret")
    get_settings.cache_clear()
    eager = app.conf.task_always_eager
    app.conf.task_always_eager = True  # the task runs inside the signal handler's ``delay``
    try:
        sid, deps = parked(model_factory)
    finally:
        app.conf.task_always_eager = eager
    assert [s.status for s in hook.seen] == [401] * (WEBHOOK_MAX_RETRIES + 1)  # bounded, then given up
    (req,) = requests()
    assert (req.status, req.notified_at) == (ApprovalStatus.PENDING, None)
    assert phase_of(sid) == Phase.WAITING_APPROVAL
    assert approve(sid, req.call_id, deps).resumed  # the approval itself does not wait for the hook
    settle(deps)
    assert runs.starts == [("refund", sid, {"order": "SECRET-ORDER-9", "amount": 30})]


def test_a_signal_handler_that_raises_never_blocks_the_request_or_its_park(
    model_factory: ModelFactory, runs: Runs
) -> None:
    def broken(**_: Any) -> None:
        raise RuntimeError("the pager is down")

    approval_requested.connect(broken, weak=False)
    try:
        sid, _ = parked(model_factory)
    finally:
        approval_requested.disconnect(broken)
    (req,) = requests()
    assert req.status == ApprovalStatus.PENDING and phase_of(sid) == Phase.WAITING_APPROVAL


def test_a_crash_right_after_the_notification_is_recorded_posts_it_again_and_records_it_once(
    model_factory: ModelFactory, runs: Runs, hook: WebhookReceiver, announced: list[Requested]
) -> None:
    parked(model_factory)
    (r,) = announced
    with armed_fault("approval.after_notified"), pytest.raises(InjectedFault):
        deliver(payload(r))
    (req,) = requests()
    first = req.notified_at
    assert first is not None
    assert deliver(payload(r))  # the task's message came back: POSTed again, same id
    assert [b["id"] for b in hook.accepted] == [r.id, r.id]  # a receiver deduplicates on id
    (req,) = requests()
    assert req.notified_at == first
