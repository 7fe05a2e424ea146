"""Soak: random delegation workloads with SIGKILLs at random moments (and now and then a Redis
flush); after each trial invariants I1–I7 are checked over the whole database.

    python bench/soak.py --trials 200 --seed 1 [--workers 2]

Prints one line per failed trial with its seed (re-run it alone with --trials 1 --seed S),
a progress line every 10 trials, and ends with `N passed, M failed`. Exit code 1 on failure.
Needs PostgreSQL and Redis (like the test suite); it creates and drops its own database.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("STACK_REDIS_DBS", "7,8,9")  # stay clear of the test suite's databases

PG_ADMIN = os.environ.get("SOAK_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")
SHAPES = ("one", "two", "mixed", "three")


def script() -> list[dict[str, Any]]:
    def d(agent: str, task: str) -> dict[str, Any]:
        return {"name": "delegate", "arguments": {"agent_type": agent, "task": task}}

    calls = {
        "one": [d("reviewer", "r1")],
        "two": [d("reviewer", "r1"), d("researcher", "s1")],
        "mixed": [d("reviewer", "r1"), {"name": "echo", "arguments": {"text": "inline"}}, d("researcher", "s1")],
        "three": [d("reviewer", "r1"), d("reviewer", "r2"), d("researcher", "s1")],
    }
    rules: list[dict[str, Any]] = []
    for shape, tool_calls in calls.items():
        rules.append(
            {
                "when": {"system_contains": "main agent", "user_contains": f"[{shape}]", "turn": 0},
                "reply": {"tool_calls": tool_calls},
            }
        )
    rules += [
        {"when": {"system_contains": "main agent", "turn": 1}, "reply": {"content": "final answer"}},
        {
            "when": {"system_contains": "subagent", "last_role": "user"},
            "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": 1}}]},
        },
        {"when": {"system_contains": "subagent", "last_role": "tool"}, "reply": {"content": "child answer"}},
    ]
    return rules


class Soak:
    def __init__(self, workers: int, log_dir: Path) -> None:
        from sqlalchemy import create_engine, text

        self.db_name = f"soak_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.db_name}"'))
        self.url = PG_ADMIN.rsplit("/", 1)[0] + "/" + self.db_name
        from demo.stack import apply_env, flush_broker, service_env
        from doubles.scripted_model import ScriptedModelServer
        from migrations import upgrade

        upgrade(self.url)
        self.model = ScriptedModelServer(script())
        self.env = service_env(self.url, self.model.start())
        apply_env(self.env)
        flush_broker()
        self.log_dir = log_dir
        self.n_workers = workers
        self.workers: list[Any] = []
        self.counter = 0

    def worker(self, beat: bool = False) -> Any:
        from demo.stack import Worker

        self.counter += 1
        w = Worker(self.env, self.log_dir, name=f"s{self.counter}", concurrency=2, beat=beat).start()
        self.workers.append(w)
        return w

    def ensure_workers(self) -> None:
        self.workers = [w for w in self.workers if not w.exited]
        has_beat = any(w.beat for w in self.workers)
        while len(self.workers) < self.n_workers:
            self.worker(beat=not has_beat)
            has_beat = True

    def reset(self) -> None:
        """Empty the tables between trials. Ids are NOT restarted: a stale message of an earlier
        trial (a duplicate callback, a late scan) must find no row, never a new trial's row."""
        from sqlalchemy import text
        from sqlalchemy.exc import OperationalError

        from demo.stack import flush_broker
        from models import get_engine

        flush_broker()
        for attempt in range(5):
            try:
                with get_engine().begin() as conn:
                    conn.execute(text("TRUNCATE message, subagent_execution, pending_round, agent_session CASCADE"))
                return
            except OperationalError:  # a late task of the last trial held a lock (deadlock detected)
                time.sleep(0.5 * (attempt + 1))
        raise RuntimeError("could not empty the tables between trials")

    def trial(self, seed: int) -> list[str]:
        import tasks
        from demo.stack import flush_broker
        from harness.views import create_session
        from models import transaction
        from recovery.invariants import check_all

        rng = random.Random(seed)
        self.reset()
        self.ensure_workers()
        parents = []
        for _ in range(rng.randint(1, 3)):
            sid = create_session("main", f"work [{rng.choice(SHAPES)}]")
            tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
            parents.append(sid)
        for _ in range(rng.randint(1, 3)):
            time.sleep(rng.uniform(0.1, 2.5))
            victim = rng.choice(self.workers)
            victim.kill()
            if rng.random() < 0.1:
                flush_broker()
            self.ensure_workers()
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            with transaction() as s:
                problems = check_all(s, settled=True)
            if not problems:
                return []
            time.sleep(0.5)
        return problems[:5]

    def close(self) -> None:
        from sqlalchemy import text

        for w in self.workers:
            w.stop()
        self.model.stop()
        from models import dispose_engines

        dispose_engines()
        with self.admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.trials < 1 or args.workers < 1:
        parser.error("--trials and --workers must be positive")
    log_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    soak = Soak(args.workers, log_dir)
    passed = failed = 0
    started = time.monotonic()
    try:
        for i in range(args.trials):
            seed = args.seed + i
            problems = soak.trial(seed)
            if problems:
                failed += 1
                print(f"FAILED seed={seed}: {'; '.join(problems)}", flush=True)
            else:
                passed += 1
            if (i + 1) % 10 == 0:
                print(
                    f"progress: {i + 1}/{args.trials} trials, {failed} failed, {time.monotonic() - started:.0f}s",
                    flush=True,
                )
    finally:
        soak.close()
    print(f"soak: {args.trials} trials in {time.monotonic() - started:.0f}s (logs in {log_dir})")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
