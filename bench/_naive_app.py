"""The naive baseline of ``bench/delegation.py``; runs only in its own worker subprocess
(``celery -A bench._naive_app:naive_app worker -Q bench_naive``) and on its own database.

The same delegation as ours, with none of the recovery machinery: no lease, no epoch, no
pending round, no delivery status or delivered marker, no compare-and-set, no tail cleanup,
no heartbeat. What it keeps is what any delegation writes: the parent's and the children's
sessions and phases, the child USER and final ASSISTANT messages, an execution row with its
status and result (the table as it was before the upgrade), the parent's assistant + TOOL
round, the parent's answer, the session_status events; and it asks the same scripted model
the same questions (the same system prompts, tool specs and history).

The round lives in the chord's messages, as a naive implementation keeps it: the parent's
assistant tool calls travel in the callback's arguments, the children's TOOL contents come
back as the header results. A crash anywhere in between loses the round (the problem our
design solves; docs/architecture.md).
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from typing import Any

from celery import Celery, chord
from celery.signals import worker_init, worker_process_init, worker_ready
from sqlalchemy import select, update

import celeryconfig
from harness.agents import get_agent
from harness.events import publish_status
from harness.history import append_message, to_openai
from harness.model import ModelClient
from harness.results import success_result
from harness.rounds import ToolResult, write_round
from harness.tools import REGISTRY, TOOL_NAMES
from models import AgentSession, ExecutionStatus, Message, Phase, Role, SessionType, SubagentExecution, transaction
from models.base import utcnow

NAIVE_QUEUE = "bench_naive"


def _app() -> Celery:
    """The project's Celery settings (acks late, prefetch 1, json) without its tasks or beat."""
    conf = celeryconfig.build()
    conf.pop("imports", None)
    conf.pop("beat_schedule", None)
    conf.update(task_default_queue=NAIVE_QUEUE)
    return Celery("bench_naive", set_as_current=False, config_source=conf)


naive_app = _app()


@worker_init.connect
def _size_the_database_pool(sender: Any = None, **_: Any) -> None:
    """On a pool that runs many loops in one process (threads, gevent), the database pool is
    sized from them as ours is (models.db.size_for_loops): both kinds get the same pool."""
    from celery.concurrency import get_implementation

    from models.db import size_for_loops

    pool_cls = getattr(sender, "pool_cls", None)
    if pool_cls is not None and not get_implementation(pool_cls).__module__.endswith((".prefork", ".solo")):
        size_for_loops(int(getattr(sender, "concurrency", 0) or 1))


@worker_process_init.connect
def _fresh_connections(**_: Any) -> None:
    from models.db import dispose_engines

    dispose_engines()


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    print("event=worker_ready", file=sys.__stderr__, flush=True)


@lru_cache(maxsize=1)
def _model() -> ModelClient:
    return ModelClient.from_settings()


def _specs(names: tuple[str, ...]) -> list[dict[str, Any]] | None:
    return [REGISTRY[n].spec() for n in names] or None


def _history(s: Any, session_id: int, system_prompt: str) -> list[dict[str, Any]]:
    rows = s.execute(select(Message).where(Message.session_id == session_id).order_by(Message.id)).scalars().all()
    return [{"role": "system", "content": system_prompt}, *to_openai(rows)]


def _set_phase(s: Any, session_id: int, phase: Phase) -> None:
    s.execute(update(AgentSession).where(AgentSession.id == session_id).values(phase=phase, updated_at=utcnow()))


@naive_app.task(name="naive.run")
def run(session_id: int) -> str:
    """The parent: ask the model; answer, or create the children and hand the round to a chord."""
    with transaction() as s:
        agent_type = s.execute(select(AgentSession.agent_type).where(AgentSession.id == session_id)).scalar_one()
        agent = get_agent(agent_type)
        _set_phase(s, session_id, Phase.RUNNING)
        messages = _history(s, session_id, agent.system_prompt)
    publish_status(session_id, Phase.RUNNING)
    reply = _model().complete(messages, _specs(agent.tool_names(TOOL_NAMES, subagent=False)))
    if not reply.tool_calls:
        with transaction() as s:
            append_message(s, session_id, Role.ASSISTANT, reply.content or "")
            _set_phase(s, session_id, Phase.WAITING_USER)
        publish_status(session_id, Phase.WAITING_USER)
        return "waiting_user"
    # The bench's script only delegates: every call of this round is a `delegate`.
    executions = []
    with transaction() as s:
        parent = s.execute(select(AgentSession).where(AgentSession.id == session_id)).scalar_one()
        for call in reply.tool_calls:
            args = json.loads(call.arguments)
            child_agent = get_agent(args["agent_type"])
            now = utcnow()
            child = AgentSession(
                user_id=parent.user_id,
                session_type=SessionType.SUBAGENT,
                parent_session_id=session_id,
                agent_type=child_agent.name,
                execution_mode=child_agent.execution_mode,
                phase=None,
                started_at=now,
                updated_at=now,
            )
            s.add(child)
            s.flush()
            append_message(s, child.id, Role.USER, args["task"])
            row = SubagentExecution(
                parent_session_id=session_id,
                child_session_id=child.id,
                agent_type=child_agent.name,
                task_description=args["task"],
                status=ExecutionStatus.RUNNING,
                started_at=now,
            )
            s.add(row)
            s.flush()
            executions.append(row.id)
    calls = [c.to_openai() for c in reply.tool_calls]
    chord([run_child.s(eid) for eid in executions])(deliver.s(session_id, reply.content, calls))
    return "yielded"


@naive_app.task(name="naive.run_child")
def run_child(execution_id: int) -> dict[str, Any]:
    """A child: ask the model once (the bench's children answer at once), write the answer,
    the execution's status and result; the TOOL content goes back through the chord."""
    with transaction() as s:
        e = s.execute(select(SubagentExecution).where(SubagentExecution.id == execution_id)).scalar_one()
        child_id, agent = e.child_session_id, get_agent(e.agent_type)
        _set_phase(s, child_id, Phase.RUNNING)
        messages = _history(s, child_id, agent.system_prompt)
    publish_status(child_id, Phase.RUNNING)
    reply = _model().complete(messages, _specs(agent.tool_names(TOOL_NAMES, subagent=True)))
    text = reply.content or ""
    result = success_result(
        agent_type=agent.name,
        child_session_id=child_id,
        text=text,
        rounds=1,
        tool_calls=0,
        prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens,
    )
    with transaction() as s:
        final = append_message(s, child_id, Role.ASSISTANT, text)
        s.execute(
            update(SubagentExecution)
            .where(SubagentExecution.id == execution_id)
            .values(
                status=ExecutionStatus.COMPLETED,
                result=result,
                final_message_id=final,
                completed_at=utcnow(),
                rounds=1,
                total_tool_calls=0,
                prompt_tokens=reply.prompt_tokens,
                completion_tokens=reply.completion_tokens,
                total_tokens=reply.prompt_tokens + reply.completion_tokens,
            )
        )
        _set_phase(s, child_id, Phase.COMPLETED)
    publish_status(child_id, Phase.COMPLETED)
    return result


@naive_app.task(name="naive.deliver")
def deliver(results: list[dict[str, Any]], session_id: int, content: str | None, calls: list[dict[str, Any]]) -> str:
    """The callback: the parent's assistant + one TOOL per call in one transaction, then the
    parent runs again."""
    tools = [
        ToolResult(str(call["id"]), json.dumps(result, ensure_ascii=False), int(result["child_session_id"]))
        for call, result in zip(calls, results, strict=True)
    ]
    with transaction() as s:
        write_round(s, session_id, content, calls, tools)
    run.apply_async((session_id,))
    return "delivered"
