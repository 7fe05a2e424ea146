"""A user's tools module outside the product packages, run by a REAL worker (`celery -A tasks
worker` subprocesses) with TOOL_MODULES and AGENTS_FILE, behind a model that answers 429 and
503 first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.processes import ROOT
from tests.helpers import installation_key, model_ids, results_by_model_id
from tests.types import StackFactory

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).resolve().parent.parent / "data"
USERTOOLS = DATA / "usertools"
SHOP = "shop agent"

SCRIPT = [
    {
        "when": {"system_contains": SHOP, "turn": 0},
        "fail_first": [{"status": 429, "retry_after": 0.5}, {"status": 503}],
        "reply": {
            "tool_calls": [
                {"name": "lookup_order", "arguments": {"order_id": 7}, "id": "call_lookup"},
                {"name": "refund_order", "arguments": {"order_id": 7, "amount_cents": 500}, "id": "call_refund"},
                {"name": "check_inventory", "arguments": {"sku": "A-1"}, "id": "call_inventory"},
                {"name": "lookup_order", "arguments": {"order_id": 0}, "id": "call_invalid"},
                {"name": "wait", "arguments": {"seconds": 0}, "id": "call_not_listed"},
            ]
        },
    },
    {"when": {"system_contains": SHOP, "turn": 1}, "reply": {"content": "done: {tool_results}"}},
]


def user_env(**extra: str) -> dict[str, str]:
    return {
        "PYTHONPATH": f"{ROOT}{os.pathsep}{USERTOOLS}",
        "TOOL_MODULES": "acme_tools",
        "AGENTS_FILE": str(DATA / "agents_usertools.toml"),
        **extra,
    }


def test_a_worker_runs_an_agent_with_tools_from_a_user_module_and_retries_an_overloaded_model(
    stack_factory: StackFactory,
) -> None:
    import hashlib

    stack = stack_factory(SCRIPT)
    stack.worker(concurrency=1, **user_env())
    sid = stack.submit("what happened to order 7?")
    snap = stack.wait_phase(sid)

    msgs = snap["messages"]
    assert [m["role"] for m in msgs] == ["USER", "ASSISTANT", "TOOL", "TOOL", "TOOL", "TOOL", "TOOL", "ASSISTANT"]
    # Rows carry our local call ids; the assistant's calls keep the model's own beside them.
    tools = results_by_model_id(msgs)
    assert json.loads(tools["call_lookup"]) == {"order_id": 7, "status": "shipped"}
    local = {model: local for local, model in model_ids(msgs).items()}
    # The key is per call, in the installation's namespace (never the session and model id).
    key = installation_key(local["call_refund"])
    assert key != hashlib.sha256(f"{sid}:call_refund".encode()).hexdigest()
    assert tools["call_refund"] == f"refunded 500 cents on order 7 with key {key}"
    assert tools["call_inventory"] == "error: ConnectionRefusedError: inventory service refused the request for A-1"
    assert tools["call_invalid"] == (
        "error: invalid arguments for tool 'lookup_order': order_id: Input should be greater than or equal to 1"
    )
    assert tools["call_not_listed"] == "error: tool 'wait' is not available"
    assert msgs[-1]["content"].startswith("done: ")

    # Two failures, then the answer: the worker retried, the session never failed.
    assert [j["reply"] for j in stack.model.journal()] == ["error", "error", "tool_calls", "content"]
    received = stack.model.received()
    assert {(r["model"], r["temperature"], r["max_tokens"]) for r in received} == {("acme-large", 0.2, 256)}
    assert received[0]["tools"] == ["echo", "lookup_order", "refund_order", "check_inventory"]
    log = stack.workers[0].log()
    assert log.count("event=model_retry") == 2 and "inventory service refused" not in log
    assert "event=tool_failed" in log and "error=ConnectionRefusedError" in log
    assert stack.invariants() == []


@pytest.mark.parametrize(
    ("modules", "agents", "expected"),
    [
        ("acme_tools", '[agents.shop]\nsystem_prompt = "p"\ntools = ["lookup_ordr"]\n', "agent 'shop' lists tool"),
        (
            "acme_tools,acme_dup_tools",
            '[agents.shop]\nsystem_prompt = "p"\ntools = ["lookup_order"]\n',
            "in module acme_tools and in module acme_dup_tools (listed by agent shop)",
        ),
    ],
)
def test_a_worker_with_a_broken_tool_configuration_stops_at_start_with_a_message(
    tmp_path: Path, modules: str, agents: str, expected: str
) -> None:
    agents_file = tmp_path / "agents.toml"
    agents_file.write_text(agents, encoding="utf-8")
    env = {**os.environ, **user_env(TOOL_MODULES=modules, AGENTS_FILE=str(agents_file))}
    env["CELERY_BROKER_URL"] = "memory://"
    worker = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tasks", "worker", "-P", "solo", "--without-mingle"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert worker.returncode != 0 and expected in worker.stderr
    assert "event=worker_ready" not in worker.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "cli.main", "status"], env=env, capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 2 and expected in cli.stderr


HOSTILE = [
    {
        "when": {"system_contains": "ops agent", "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "pool_pid", "arguments": {}, "id": "call_pid_before"},
                {"name": "report", "arguments": {"command_line": "--days many"}, "id": "call_argparse"},
                {"name": "interrupt", "arguments": {}, "id": "call_ctrl_c"},
                {"name": "shop_queue_push", "arguments": {"item": "x"}, "id": "call_wrongtype"},
                {"name": "thumbnail", "arguments": {}, "id": "call_bytes"},
                {"name": "pool_pid", "arguments": {}, "id": "call_pid_after"},
            ]
        },
    },
    {"when": {"system_contains": "ops agent", "turn": 1}, "reply": {"content": "done"}},
]


def test_systemexit_keyboardinterrupt_the_shops_redis_errors_and_binary_output_are_tool_results_in_a_real_worker(
    stack_factory: StackFactory, redis_url: str
) -> None:
    from urllib.parse import urlsplit

    shop = urlsplit(redis_url)._replace(path="/13").geturl()
    stack = stack_factory(HOSTILE)
    stack.worker(
        concurrency=1,
        PYTHONPATH=f"{ROOT}{os.pathsep}{USERTOOLS}",
        TOOL_MODULES="hostile_tools",
        AGENTS_FILE=str(DATA / "agents_hostile.toml"),
        SHOP_REDIS_URL=shop,
    )
    sid = stack.submit("check the ops")
    snap = stack.wait_phase(sid, ("WAITING_USER", "FAILED"))
    assert snap["phase"] == "WAITING_USER"
    tools = results_by_model_id(snap["messages"])
    assert tools["call_argparse"] == "error: SystemExit: 2"
    assert tools["call_ctrl_c"] == "error: KeyboardInterrupt"
    assert tools["call_wrongtype"].startswith("error: ResponseError: WRONGTYPE")
    assert tools["call_bytes"] == "base64:/9j/4A=="
    # The same pool process ran the calls before and after SystemExit and KeyboardInterrupt.
    assert tools["call_pid_before"] == tools["call_pid_after"]
    assert snap["messages"][-1]["content"] == "done"
    assert "WorkerLostError" not in stack.workers[0].log()
    assert stack.invariants() == []
