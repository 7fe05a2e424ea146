"""Normal-path cost of one delegating round: ``python bench/delegation.py [--runs R] [--rounds N]``.

With an instant scripted model, a parent delegates K children that answer at once; measured
from the delegation's commit (the children's sessions written; for ours also
``pending_round.created_at``) to the parent resumed (its next answer committed after the
delivered round), and for ours to the delivery itself (``pending_round.closed_at``). Rounds
run one at a time on one real prefork worker per kind. Three kinds alternate, round by round,
on the same broker and the same PostgreSQL server:

- ours: ``agent.run`` on the project's worker;
- naive (``bench/_naive_app.py``, its own queue, worker and database): the same delegation —
  the same model calls to the same scripted model, the same message rows, a chord of the same
  shape (ours sends no chord: its last child delivers) — with none of the recovery
  machinery. ``ours / naive`` is what crash safety costs;
- bare chord (the floor): a small app defined here, K no-op header tasks, a callback (the
  delivery), then one more task (the parent's resumed run), timed from the enqueue.

Each of ``--runs`` runs measures ``--rounds`` rounds of each kind; prints every run's p50s
and the medians over the runs of the p50s and of the ratios ours/naive and ours/bare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from celery import Celery, chord
from celery.signals import worker_ready

import celeryconfig

MAIN = "main agent"
BARE_QUEUE = "bench_chord"


def _bare_app() -> Celery:
    """The project's Celery settings (acks late, prefetch 1, json) without its tasks or beat."""
    conf = celeryconfig.build()
    conf.pop("imports", None)
    conf.pop("beat_schedule", None)
    conf.update(task_default_queue=BARE_QUEUE)
    return Celery("bench_chord", set_as_current=False, config_source=conf)


chord_app = _bare_app()


def _record(key: str) -> None:
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.rpush(key, repr(time.time()))
    client.close()


@chord_app.task(name="bench.noop")
def noop(i: int) -> int:
    """A header task that does nothing (a child that answers at once, without the database)."""
    return i


@chord_app.task(name="bench.deliver")
def deliver(results: list[int], key: str) -> None:
    """The callback: records when it ran, then starts the 'parent' again."""
    _record(key + ":delivered")
    resume.apply_async((key,))


@chord_app.task(name="bench.resume")
def resume(key: str) -> None:
    _record(key + ":resumed")


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    # Only a worker of this app imports this module; bare_worker().start() waits for the line.
    print("event=worker_ready", file=sys.__stderr__, flush=True)


def app_worker(
    app: str, queue: str, name: str, env: dict[str, str], log_dir: Path, concurrency: int, pool: str = "prefork"
) -> Any:
    """``celery -A APP worker -P POOL -Q QUEUE``, on the pool ours uses."""
    from devstack.processes import Service

    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app,
        "worker",
        "-P",
        pool,
        "-c",
        str(concurrency),
        "-Q",
        queue,
        "-n",
        f"{name}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "INFO",
    ]
    return Service(cmd, env, log_dir / f"worker-{name}.log", "event=worker_ready")


def instant_script(children: int) -> list[dict[str, Any]]:
    calls = [
        {"name": "delegate", "arguments": {"agent_type": ("reviewer", "researcher")[i % 2], "task": f"part {i}"}}
        for i in range(children)
    ]
    return [
        {"when": {"system_contains": MAIN, "turn": 0}, "reply": {"tool_calls": calls}},
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "combined: {tool_results}"}},
        {"when": {"system_contains": "subagent"}, "reply": {"content": "child answer"}},
    ]


def our_round(n: int, timeout: float) -> tuple[float, float, float]:
    """One delegating round on the real stack; (round commit -> delivered, round commit ->
    resumed, delegation -> resumed) seconds from the timestamps the workers wrote."""
    from sqlalchemy import text

    import tasks
    from bench._common import wait_for
    from harness.views import create_session
    from models import transaction

    sid = create_session("main", f"round {n}: split the work")
    tasks.app.signature("agent.run", args=(sid, 0)).apply_async()

    def phase() -> str | None:
        with transaction() as s:
            return s.execute(text("SELECT phase FROM agent_session WHERE id = :i"), {"i": sid}).scalar_one()

    wait_for(lambda: phase() in ("WAITING_USER", "FAILED"), timeout=timeout, what=f"round {n}", interval=0.01)
    if phase() != "WAITING_USER":
        raise RuntimeError(f"round {n}: the parent ended {phase()} (see the worker log)")
    with transaction() as s:
        created, closed = s.execute(
            text("SELECT created_at, closed_at FROM pending_round WHERE session_id = :i"), {"i": sid}
        ).one()
        delegated, resumed = _delegation_times(s, sid)
    return (
        (closed - created).total_seconds(),
        (resumed - created).total_seconds(),
        (resumed - delegated).total_seconds(),
    )


def _delegation_times(s: Any, sid: int) -> tuple[Any, Any]:
    """(the delegation: the first child session written, the parent's answer committed)."""
    from sqlalchemy import text

    delegated = s.execute(
        text("SELECT min(started_at) FROM agent_session WHERE parent_session_id = :i"), {"i": sid}
    ).scalar_one()
    resumed = s.execute(
        text(
            "SELECT max(created_at) FROM message WHERE session_id = :i AND role = 'ASSISTANT'"
            " AND tool_calls IS NULL AND NOT deleted"
        ),
        {"i": sid},
    ).scalar_one()
    return delegated, resumed


def naive_round(n: int, url: str, timeout: float) -> float:
    """One delegating round on the naive worker (its own database ``url``); delegation ->
    the parent's answer committed, in seconds."""
    from sqlalchemy import text

    from bench._common import naive_sessions, wait_for
    from bench._naive_app import run
    from models import transaction

    (sid,) = naive_sessions(url, [f"round {n}: split the work"])
    run.apply_async((sid,))

    def phase() -> str | None:
        with transaction(url) as s:
            return s.execute(text("SELECT phase FROM agent_session WHERE id = :i"), {"i": sid}).scalar_one()

    wait_for(lambda: phase() == "WAITING_USER", timeout=timeout, what=f"naive round {n}", interval=0.01)
    with transaction(url) as s:
        delegated, resumed = _delegation_times(s, sid)
    return (resumed - delegated).total_seconds()


def bare_round(n: int, children: int, timeout: float) -> tuple[float, float]:
    """One bare chord; (enqueue -> callback ran, enqueue -> follow-up task ran) seconds."""
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    key = f"bench:chord:{os.getpid()}:{n}"
    try:
        started = time.time()
        chord([noop.s(i) for i in range(children)])(deliver.s(key))
        got = client.blpop([key + ":resumed"], timeout=timeout)
        if got is None:
            raise RuntimeError(f"bare chord {n} did not finish within {timeout:g}s")
        resumed = float(got[1])
        delivered = float(client.lpop(key + ":delivered") or "nan")
    finally:
        client.delete(key + ":delivered", key + ":resumed")
        client.close()
    return delivered - started, resumed - started


def _drop_result_subscriptions(app: Celery) -> None:
    """Celery keeps the chord headers' results subscribed in this process; unsubscribe them
    while the interpreter is alive (their __del__ at exit would fail on a closing Redis pool)."""
    backend = app.backend
    for mapping in getattr(backend, "_pending_results", ()):
        for waiters in list(mapping.values()):
            for result in list(waiters.values()):
                backend.remove_pending_result(result)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/delegation.py", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs; medians over them are printed (default 5)")
    parser.add_argument("--rounds", type=int, default=20, help="measured rounds of each kind per run (default 20)")
    parser.add_argument("--children", type=int, default=2, help="children per round, header tasks per chord (2)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds of each kind not counted (default 3)")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork pool size of each worker (default 2)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rounds < 1 or args.children < 1 or args.warmup < 0 or args.concurrency < 1:
        parser.error("--runs, --rounds, --children and --concurrency must be >= 1, --warmup >= 0")
    return args


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:6.1f} ms"


@dataclass
class Run:
    ours_delivered: list[float] = field(default_factory=list)  #: round commit -> delivered
    ours_resumed: list[float] = field(default_factory=list)  #: round commit -> parent resumed
    ours: list[float] = field(default_factory=list)  #: delegation -> parent resumed
    naive: list[float] = field(default_factory=list)  #: delegation -> parent resumed
    bare_delivered: list[float] = field(default_factory=list)  #: enqueue -> callback
    bare: list[float] = field(default_factory=list)  #: enqueue -> follow-up task

    def p50(self, name: str) -> float:
        return float(statistics.median(getattr(self, name)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench._common import Stack, bench_database, bench_env, flush_redis, percentile, progress
    from bench._figures import median, system_load
    from bench._naive_app import NAIVE_QUEUE, naive_app
    from devstack.processes import apply_env

    runs: list[Run] = []
    with bench_database("bench_delegation") as url, bench_database("bench_naive") as naive_url:
        flush_redis()
        with Stack("bench-delegation") as stack:
            model = stack.model(instant_script(args.children))
            env = bench_env(url, model.base_url)
            apply_env(env)
            for app in (chord_app, naive_app):
                app.conf.update(broker_url=env["CELERY_BROKER_URL"], result_backend=env["CELERY_RESULT_BACKEND"])
            stack.worker(env, "ours", concurrency=args.concurrency)
            naive_env = bench_env(naive_url, model.base_url)
            stack.add_worker(
                app_worker(
                    "bench._naive_app:naive_app", NAIVE_QUEUE, "naive", naive_env, stack.log_dir, args.concurrency
                )
            ).start()
            stack.add_worker(
                app_worker("bench.delegation:chord_app", BARE_QUEUE, "bare", env, stack.log_dir, args.concurrency)
            ).start()
            print(
                f"delegation: {args.runs} runs x {args.rounds} rounds of 1 parent -> {args.children} children "
                f"(instant model), one at a time, ours / naive / bare chord alternating; 1 worker x "
                f"{args.concurrency} pool processes each; {system_load()}",
                flush=True,
            )
            try:
                n = 0
                for _ in range(args.warmup):
                    our_round(n, timeout=30)
                    naive_round(n, naive_url, timeout=30)
                    bare_round(n, args.children, timeout=30)
                    n += 1
                for r in range(1, args.runs + 1):
                    run = Run()
                    for _ in range(args.rounds):
                        delivered, resumed, ours = our_round(n, timeout=30)
                        naive = naive_round(n, naive_url, timeout=30)
                        bare_delivered, bare = bare_round(n, args.children, timeout=30)
                        run.ours_delivered.append(delivered)
                        run.ours_resumed.append(resumed)
                        run.ours.append(ours)
                        run.naive.append(naive)
                        run.bare_delivered.append(bare_delivered)
                        run.bare.append(bare)
                        n += 1
                    runs.append(run)
                    progress(
                        f"run {r}: p50 ours {_ms(run.p50('ours'))}, naive {_ms(run.p50('naive'))}, bare chord "
                        f"{_ms(run.p50('bare'))}; ours/naive {run.p50('ours') / run.p50('naive'):.2f}, ours/bare "
                        f"{run.p50('ours') / run.p50('bare'):.2f}; {system_load()}"
                    )
            except Exception:
                stack.failed = True
                stack.dump_logs()
                raise
            from models import transaction
            from recovery.invariants import check_all

            with transaction() as s:
                problems = check_all(s, settled=True)
            for app in (chord_app, naive_app):
                _drop_result_subscriptions(app)
                app.close()

    def line(name: str) -> str:
        p50 = median([r.p50(name) for r in runs])
        pooled = [x for r in runs for x in getattr(r, name)]
        return f"p50 {_ms(p50)}  p99 {_ms(percentile(pooled, 99))}"

    count = f"median of {args.runs} runs' p50; p99 over all {args.runs * args.rounds} rounds"
    print(f"ours, round commit -> delivered:      {line('ours_delivered')}  (pending_round created -> closed)")
    print(f"ours, round commit -> parent resumed: {line('ours_resumed')}  ({count})")
    print(f"ours, delegation -> parent resumed:   {line('ours')}  (first child session -> the parent's answer)")
    print(f"naive, delegation -> parent resumed:  {line('naive')}  (the same, without recovery machinery)")
    print(f"bare chord, enqueue -> callback:      {line('bare_delivered')}  ({args.children} no-op headers)")
    print(f"bare chord, enqueue -> follow-up:     {line('bare')}  (callback -> one more task ran)")
    ours_naive = [r.p50("ours") / r.p50("naive") for r in runs]
    ours_bare = [r.p50("ours") / r.p50("bare") for r in runs]
    naive_bare = [r.p50("naive") / r.p50("bare") for r in runs]
    print(
        f"ratio ours/naive p50: {median(ours_naive):.2f} (median of {args.runs} runs, each {min(ours_naive):.2f}"
        f" .. {max(ours_naive):.2f}); {system_load()}"
    )
    print(
        f"ratio ours/bare p50: {median(ours_bare):.2f}, naive/bare p50: {median(naive_bare):.2f} "
        f"(the bare chord is the floor)"
    )
    if problems:
        print(f"invariants I1-I5: VIOLATED ({len(problems)})")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(f"invariants I1-I5: ok ({args.warmup + args.runs * args.rounds} parents of ours)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
