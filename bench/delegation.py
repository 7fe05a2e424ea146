"""Normal-path overhead of one delegating round: ``python bench/delegation.py [--rounds N]``.

With an instant scripted model, a parent delegates K children that answer at once; measured
from the round's commit (``pending_round.created_at``) to the parent resumed (its next answer
committed after the delivered round), and to the delivery itself (``pending_round.closed_at``).
Rounds run one at a time on one real prefork worker.

Beside it, in the same run and on the same broker, a bare Celery chord of the same shape on a
small app defined here (its own queue and worker): K no-op header tasks, a callback (the
delivery), then one more task (the parent's resumed run), timed from the enqueue. Rounds of
both kinds alternate. Prints p50/p99 of both and the ratio ours/bare.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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


def bare_worker(env: dict[str, str], log_dir: Path, concurrency: int) -> Any:
    """``celery -A bench.delegation:chord_app worker -Q bench_chord``, prefork like ours."""
    from demo.stack import Service

    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "bench.delegation:chord_app",
        "worker",
        "-P",
        "prefork",
        "-c",
        str(concurrency),
        "-Q",
        BARE_QUEUE,
        "-n",
        "bare@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "INFO",
    ]
    return Service(cmd, env, log_dir / "worker-bare.log", "event=worker_ready")


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


def our_round(n: int, timeout: float) -> tuple[float, float]:
    """One delegating round on the real stack; (commit -> delivered, commit -> resumed) seconds
    from the timestamps the workers wrote."""
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
        resumed = s.execute(
            text(
                "SELECT max(created_at) FROM message WHERE session_id = :i AND role = 'ASSISTANT'"
                " AND tool_calls IS NULL AND NOT deleted"
            ),
            {"i": sid},
        ).scalar_one()
    return (closed - created).total_seconds(), (resumed - created).total_seconds()


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


def _drop_result_subscriptions() -> None:
    """Celery keeps the chord headers' results subscribed in this process; unsubscribe them
    while the interpreter is alive (their __del__ at exit would fail on a closing Redis pool)."""
    backend = chord_app.backend
    for mapping in getattr(backend, "_pending_results", ()):
        for waiters in list(mapping.values()):
            for result in list(waiters.values()):
                backend.remove_pending_result(result)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/delegation.py", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help="measured rounds of each kind (default 100)")
    parser.add_argument("--children", type=int, default=2, help="children per round, header tasks per chord (2)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds of each kind not counted (default 3)")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork pool size of each worker (default 2)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.children < 1 or args.warmup < 0 or args.concurrency < 1:
        parser.error("--rounds, --children and --concurrency must be >= 1, --warmup >= 0")
    return args


def _line(label: str, samples: list[float]) -> str:
    from bench._common import percentile

    return f"p50 {percentile(samples, 50) * 1000:7.1f} ms  p99 {percentile(samples, 99) * 1000:7.1f} ms  ({label})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench._common import Stack, bench_database, bench_env, flush_redis, progress
    from demo.stack import apply_env

    ours: list[tuple[float, float]] = []
    bare: list[tuple[float, float]] = []
    with bench_database("bench_delegation") as url:
        flush_redis()
        with Stack("bench-delegation") as stack:
            model = stack.model(instant_script(args.children))
            env = bench_env(url, model.base_url)
            apply_env(env)
            chord_app.conf.update(
                broker_url=env["CELERY_BROKER_URL"],
                result_backend=env["CELERY_RESULT_BACKEND"],
            )
            stack.worker(env, "ours", concurrency=args.concurrency)
            stack.add_worker(bare_worker(env, stack.log_dir, args.concurrency)).start()
            print(
                f"delegation: {args.rounds} rounds of 1 parent -> {args.children} children (instant model), one at "
                f"a time, alternating with a bare Celery chord of the same shape; 1 worker x "
                f"{args.concurrency} pool processes each",
                flush=True,
            )
            total = args.warmup + args.rounds
            try:
                for n in range(total):
                    a = our_round(n, timeout=30)
                    b = bare_round(n, args.children, timeout=30)
                    if n >= args.warmup:
                        ours.append(a)
                        bare.append(b)
                    if (n + 1) % 25 == 0 and n + 1 < total:
                        progress(f"{n + 1}/{total} rounds of each kind")
            except Exception:
                stack.failed = True
                stack.dump_logs()
                raise
            from models import transaction
            from recovery.invariants import check_all

            with transaction() as s:
                problems = check_all(s, settled=True)
            _drop_result_subscriptions()
            chord_app.close()
    our_delivered, our_resumed = [d for d, _ in ours], [r for _, r in ours]
    bare_delivered, bare_resumed = [d for d, _ in bare], [r for _, r in bare]
    print("ours, round commit -> delivered:      " + _line("pending_round.created_at -> closed_at", our_delivered))
    print("ours, round commit -> parent resumed: " + _line("-> the parent's next answer committed", our_resumed))
    headers = f"{args.children} no-op headers -> callback"
    print("bare chord, enqueue -> callback:      " + _line(headers, bare_delivered))
    print("bare chord, enqueue -> follow-up:     " + _line("callback -> one more task ran", bare_resumed))
    from bench._common import percentile

    print(
        "ratio ours/bare (parent resumed vs follow-up): "
        f"p50 {percentile(our_resumed, 50) / percentile(bare_resumed, 50):.1f}x, "
        f"p99 {percentile(our_resumed, 99) / percentile(bare_resumed, 99):.1f}x"
    )
    if problems:
        print(f"invariants I1-I5: VIOLATED ({len(problems)})")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(f"invariants I1-I5: ok ({len(ours) + args.warmup} parents)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
