"""The DBOS Transact side of ``bench/peer_dbos.py``; runs only in its subprocesses.

``python -m bench._dbos_app start P`` launches DBOS and starts P parent workflows;
``python -m bench._dbos_app recover`` only launches DBOS, whose startup recovery resumes every
PENDING workflow of this executor; ``python -m bench._dbos_app serve`` launches DBOS and runs
whatever is enqueued on the ``parents`` queue (by ``DBOSClient`` from peer_dbos.py: the normal
path, several such processes share the queues). Each prints ``t0=<epoch seconds>`` just before
``DBOS.launch()`` and then idles until it is killed.

The workload is the one ``bench/recovery.py`` crashes: a parent asks the scripted model (over
HTTP, a checkpointed step) and gets K ``delegate`` calls; it enqueues one child workflow per
call on a queue whose per-process concurrency matches our pool size; each child asks the model
once; the parent waits for every child (fan-in), writes the round (one assistant row + one
TOOL row per child) in ONE datasource transaction (exactly once), asks the model again and
writes its final answer.

Configuration comes from the environment (set by peer_dbos.py): BENCH_DBOS_DATABASE_URL,
BENCH_MODEL_URL, BENCH_DBOS_CONCURRENCY (child workflows at once per process),
BENCH_DBOS_POLL_SECONDS, BENCH_DBOS_EXECUTOR_ID (DBOS's default ``local`` when unset),
BENCH_DBOS_POOL_SIZE (both of DBOS's connection pools; DBOS's defaults when unset).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import requests
import sqlalchemy as sa
from dbos import DBOS, DBOSConfig, SQLAlchemyDatasource

DATABASE_URL = os.environ["BENCH_DBOS_DATABASE_URL"]
MODEL_URL = os.environ["BENCH_MODEL_URL"]
CONCURRENCY = int(os.environ.get("BENCH_DBOS_CONCURRENCY", "2"))
#: Queue and result polling interval (DBOS's default is 1 s).
POLL_SECONDS = float(os.environ.get("BENCH_DBOS_POLL_SECONDS", "0.05"))
QUEUE = "children"
#: Parent workflows enqueued by a DBOSClient (the normal path); no concurrency limit, as ours
#: takes every parent as soon as a pool process is free.
PARENTS_QUEUE = "parents"
EXECUTOR_ID = os.environ.get("BENCH_DBOS_EXECUTOR_ID", "")
#: Connections of DBOS's system database pool and of the datasource's pool (each); 0: DBOS's
#: defaults (20, and 5 + 10 overflow), which 2,000 parent workflows at once in one process exhaust.
POOL_SIZE = int(os.environ.get("BENCH_DBOS_POOL_SIZE", "0"))

MAIN_PROMPT = "You are the main agent. Delegate work to subagents with the delegate tool and combine results."
CHILD_PROMPT = "You are the reviewer subagent. Review what you are given and answer with your findings."

config: DBOSConfig = {"name": "bench-peer-dbos", "system_database_url": DATABASE_URL, "log_level": "WARNING"}
if EXECUTOR_ID:
    config["executor_id"] = EXECUTOR_ID
if POOL_SIZE:
    config["sys_db_pool_size"] = POOL_SIZE
DBOS(config=config)
db = SQLAlchemyDatasource.create(
    DATABASE_URL, engine_kwargs={"pool_size": POOL_SIZE, "max_overflow": 0} if POOL_SIZE else None
)

MESSAGES = sa.Table(
    "peer_message",
    sa.MetaData(),
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("job", sa.String(64), nullable=False),
    sa.Column("role", sa.String(20), nullable=False),
    sa.Column("content", sa.Text),
    sa.Column("tool_calls", sa.Text),
    sa.Column("tool_call_id", sa.String(128)),
    sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
)


_local = threading.local()


def _http() -> requests.Session:
    """A keep-alive session per thread (the steps may run on several), as our ModelClient keeps
    one per process: both sides reuse their connections to the stand-in."""
    session: requests.Session | None = getattr(_local, "session", None)
    if session is None:
        session = _local.session = requests.Session()
    return session


def _chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
    response = _http().post(
        MODEL_URL + "/chat/completions", json={"model": "scripted", "messages": messages}, timeout=(5, 900)
    )
    response.raise_for_status()
    message: dict[str, Any] = response.json()["choices"][0]["message"]
    return message


@DBOS.step()
def ask_model(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return _chat(messages)


@DBOS.workflow()
def child_workflow(job: str, task: str) -> str:
    reply = ask_model([{"role": "system", "content": CHILD_PROMPT}, {"role": "user", "content": task}])
    return str(reply.get("content") or "")


@db.transaction()
def deliver_round(job: str, assistant: dict[str, Any], results: list[str]) -> None:
    session = db.sql_session()
    calls = assistant["tool_calls"]
    rows = [{"job": job, "role": "ASSISTANT", "content": "", "tool_calls": json.dumps(calls), "tool_call_id": None}]
    rows += [
        {"job": job, "role": "TOOL", "content": result, "tool_calls": None, "tool_call_id": call["id"]}
        for call, result in zip(calls, results, strict=True)
    ]
    session.execute(MESSAGES.insert(), rows)


@db.transaction()
def write_answer(job: str, content: str) -> None:
    db.sql_session().execute(MESSAGES.insert(), [{"job": job, "role": "ASSISTANT", "content": content}])


@DBOS.workflow()
def parent_workflow(job: str) -> str:
    messages: list[dict[str, Any]] = [{"role": "system", "content": MAIN_PROMPT}, {"role": "user", "content": job}]
    reply = ask_model(messages)
    queue = DBOS.retrieve_queue(QUEUE)
    assert queue is not None
    handles = [
        queue.enqueue(child_workflow, job, json.loads(call["function"]["arguments"])["task"])
        for call in reply["tool_calls"]
    ]
    results = [handle.get_result(polling_interval_sec=POLL_SECONDS) for handle in handles]
    deliver_round(job, reply, results)
    messages.append({"role": "assistant", "content": None, "tool_calls": reply["tool_calls"]})
    messages += [
        {"role": "tool", "tool_call_id": call["id"], "content": result}
        for call, result in zip(reply["tool_calls"], results, strict=True)
    ]
    final = ask_model(messages)
    write_answer(job, str(final.get("content") or ""))
    return str(final.get("content") or "")


def main(argv: list[str]) -> int:
    phase = argv[0]
    if phase in ("start", "serve"):
        MESSAGES.create(db.engine, checkfirst=True)
    print(f"t0={time.time()!r}", flush=True)
    DBOS.launch()
    DBOS.register_queue(QUEUE, worker_concurrency=CONCURRENCY, polling_interval_sec=POLL_SECONDS)
    if phase == "serve":
        DBOS.register_queue(PARENTS_QUEUE, polling_interval_sec=POLL_SECONDS)
    if phase == "start":
        for n in range(int(argv[1])):
            DBOS.start_workflow(parent_workflow, f"job {n}")
    print("event=launched", flush=True)
    while True:  # until killed
        time.sleep(3600)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
