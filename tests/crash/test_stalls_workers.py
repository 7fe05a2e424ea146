"""Stalls through real workers (``celery -A tasks worker``, LEASE_SECONDS=3 in the stack): a
process SIGSTOPped with a transaction open holds nothing past its lease, a live process whose
database connection froze (tests/faultproxy.py ``freeze_on``) stops renewing the lease of the
work stuck on it, a parent never answers twice, and a parent taken over while it was stopped
starts none of its round's inline tools when it wakes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from devstack.processes import ROOT
from tests.crash.test_liveness import DATA, MAIN, _dead_child, script
from tests.faultproxy import FaultProxy
from tests.helpers import executions_of, messages_of, wait_until

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]

LEASE = 3.0  # LEASE_SECONDS of the test stack
SCAN = 2.0  # SCAN_INTERVAL_SECONDS of the test stack


def _final_answers(sid: int) -> list[int]:
    return [m.id for m in messages_of(sid) if m.role == "ASSISTANT" and not json.loads(m.tool_calls or "[]")]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_parent_stalled_inside_its_delegating_transaction_for_three_leases_answers_once(
    stack_factory: Any, pool: str
) -> None:
    # On a threads pool the stop freezes every loop of the process at once, its heartbeat
    # threads with them.
    stack = stack_factory(script())
    frozen = stack.worker(
        "frozen",
        concurrency=1 if pool == "prefork" else 8,
        pool=pool,
        CRASH_POINT="delegate.after_user_message",
        CRASH_POINT_MODE="stop",
    )
    sid = stack.submit("plain")
    wait_until(lambda: "crash_point=delegate.after_user_message" in frozen.log(), timeout=60, what="the parent froze")
    stack.worker("other", beat=True, pool=pool, concurrency=2 if pool == "prefork" else 8)
    time.sleep(3 * LEASE)  # stalled with its round's transaction open, past its lease
    os.killpg(frozen.proc.pid, signal.SIGCONT)
    stack.wait_phase(sid, timeout=90)
    time.sleep(2 * LEASE)  # a second answer, if any, would come now
    assert len(_final_answers(sid)) == 1, [(m.role, m.content) for m in messages_of(sid)]
    assert stack.invariants() == []


def test_a_scanner_stalled_inside_its_batch_holds_no_row_and_another_scanner_recovers_the_dead_rows(
    stack_factory: Any,
) -> None:
    stack = stack_factory(script())
    parent, eid = _dead_child()
    frozen = stack.worker(
        "frozen", concurrency=1, queues="recovery", CRASH_POINT="scan.inside_batch", CRASH_POINT_MODE="stop"
    )
    wait_until(lambda: "crash_point=scan.inside_batch" in frozen.log(), timeout=60, what="the scanner froze in a batch")
    other = stack.worker("other", beat=True)
    ready = time.monotonic()
    wait_until(
        lambda: (
            (executions_of(parent)[0].lease_owner or "").startswith("other")
            or executions_of(parent)[0].delivery_status == "DELIVERED"
        ),
        timeout=60,
        interval=0.1,
        what="another scanner recovered the dead row",
    )
    took = time.monotonic() - ready
    # The stalled batch's transaction is ended by the server within half a lease and the frozen
    # right lapses within one: the other worker's boot scan (or the next beat's, every 2 s)
    # recovers the row within two leases of its start.
    assert took < 2 * LEASE + 2, f"the dead row waited {took:.1f}s behind the stalled scanner"
    assert not other.exited
    stack.wait_phase(parent, timeout=60)
    os.killpg(frozen.proc.pid, signal.SIGCONT)
    assert {e.id: e.delivery_status for e in executions_of(parent)} == {eid: "DELIVERED"}
    time.sleep(LEASE)
    assert stack.invariants() == []


def test_a_parent_whose_connection_freezes_in_its_delegating_transaction_is_taken_back_and_answers_once(
    stack_factory: Any,
) -> None:
    """The worker's connection freezes (bytes held, no reset) as it sends the round's pending
    round: its process lives on and its heartbeat could renew the parent's lease for ever. A
    lease is renewed only while its holder makes progress, so it lapses and the scan hands the
    parent to a free slot; the frozen run's late writes, once thawed, land nowhere."""
    stack = stack_factory(script())
    with FaultProxy.for_url(stack.env["DATABASE_URL"]) as proxy:
        # The only worker on the default queue (parents and children) reaches PostgreSQL through
        # the proxy; the other one scans and delivers, straight to the server.
        frozen = stack.worker("frozen", concurrency=2, DATABASE_URL=proxy.rewrite(stack.env["DATABASE_URL"]))
        stack.worker("other", queues="recovery", beat=True)
        proxy.freeze_on(b"INSERT INTO pending_round")
        sid = stack.submit("plain")
        wait_until(lambda: proxy.stats().frozen == 1, timeout=60, what="the delegating transaction froze")
        froze = time.monotonic()
        # The lease lapses at most half a lease (no more renewals) + one lease after the freeze,
        # and the next scan (every SCAN) takes it; then the parent's work, a few seconds at most
        # beside other suites (about 6 s from the freeze to the end on a quiet machine).
        snap = stack.wait_phase(sid, timeout=2 * LEASE + SCAN + 20)
        took = time.monotonic() - froze
        assert proxy.stats().frozen == 1 and proxy.stats().cuts == 0  # still frozen, never reset
        assert took < 2 * LEASE + SCAN + 4, f"the parent finished {took:.1f}s after the freeze"
        assert [m["role"] for m in snap["messages"]] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
        assert {(e.status, e.delivery_status) for e in executions_of(sid)} == {("COMPLETED", "DELIVERED")}
        assert "event=lease_not_renewed" in frozen.log()
        assert stack.invariants() == []
        assert proxy.thaw() == 1
        # The server ended the frozen transaction (idle for half a lease): its late INSERT fails.
        wait_until(lambda: "event=agent_run_infra_error" in frozen.log(), timeout=30, what="the thawed run ended")
        time.sleep(LEASE)  # a late write, if any, would land now
    assert len(_final_answers(sid)) == 1, [(m.role, m.content) for m in messages_of(sid)]
    assert [m.role for m in messages_of(sid)] == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    assert len(executions_of(sid)) == 2
    assert not frozen.exited


#: A main agent that may ``charge`` (tests/data/usertools/charge_tools.py: not safe to repeat,
#: every real run appended to CHARGE_TOOL_LOG) in the same reply as its delegation.
CHARGE_ENV = {
    "PYTHONPATH": f"{ROOT}{os.pathsep}{DATA / 'usertools'}",
    "TOOL_MODULES": "charge_tools",
    "AGENTS_FILE": str(DATA / "agents_charge.toml"),
}


def charge_script() -> list[dict[str, Any]]:
    return [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {
                "tool_calls": [
                    {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "review the order"}},
                    {"name": "charge", "arguments": {"order": "A-1", "amount": 30}},
                ]
            },
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final: {tool_results}"}},
        {"when": {"system_contains": "subagent"}, "reply": {"content": "child answer"}},
    ]


#: Where the parent stops, how often the charge has run at the end, and what the model is told
#: of it: stopped before the charge's fenced start, the woken process starts nothing and the
#: model is told the charge did not run; stopped after it (the start committed, the charge not
#: yet run), the woken process runs it once, late, and the model was told it may have run.
STOPS = [
    ("delegate.after_create", 0, "was not run"),
    ("parent.after_inline_start", 1, "may or may not have taken effect"),
]


@pytest.mark.parametrize(("point", "runs", "told"), STOPS, ids=["before_the_start", "after_the_start"])
def test_a_parent_stopped_in_its_inline_charge_and_taken_over_charges_at_most_once_and_tells_the_model_the_truth(
    stack_factory: Any, tmp_path: Path, point: str, runs: int, told: str
) -> None:
    charges = tmp_path / "charges.log"
    env = {**CHARGE_ENV, "CHARGE_TOOL_LOG": str(charges)}
    stack = stack_factory(charge_script())
    frozen = stack.worker("frozen", concurrency=1, CRASH_POINT=point, CRASH_POINT_MODE="stop", **env)
    sid = stack.submit("charge and review")
    wait_until(lambda: f"crash_point={point}" in frozen.log(), timeout=60, what="the parent froze")
    stack.worker("other", beat=True, **env)
    # The child ends; the scan takes the stalled parent over (its lease lapsed) and delivers
    # the round; the parent answers.
    stack.wait_phase(sid, timeout=90)
    os.killpg(frozen.proc.pid, signal.SIGCONT)
    wait_until(lambda: "agent_run_lost" in frozen.log(), timeout=30, what="the woken parent found its lease lost")
    ran = charges.read_text(encoding="utf-8").splitlines() if charges.exists() else []
    assert len(ran) == runs, f"the charge ran {len(ran)} time(s) after the take-over: {ran}"
    calls = [c for m in messages_of(sid) for c in json.loads(m.tool_calls or "[]")]
    (call,) = [c for c in calls if c["function"]["name"] == "charge"]
    (result,) = [m.content or "" for m in messages_of(sid) if m.role == "TOOL" and m.tool_call_id == call["id"]]
    assert told in result, result
    assert stack.invariants() == []
