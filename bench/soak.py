"""Soak: random delegation workloads under a fault chosen at random per trial; after each
trial invariants I1–I7 are checked over the whole database.

    python bench/soak.py --trials 1000 --seed 1 [--workers 3] [--pool prefork|threads] [--concurrency 2]

Fault kinds (docs/fault-model.md): ``kill_one`` SIGKILLs one of several workers (not all) and restarts it,
under its own name half the time (boot generation) or as a new worker; ``kill_in_recovery``
kills a worker, then kills the worker that is recovering its work; ``redis_restart`` kills the
private redis-server and starts it EMPTY; ``pg_cuts`` resets every PostgreSQL connection of the
workers (through a fault proxy) every 300 ms for 3 s. Then the liveness faults: ``freeze_scanner`` SIGSTOPs
one worker (its pool included, so a scan it runs keeps its right to scan, and its children
keep their leases) for three scan intervals, then lets it go on (SIGCONT): its leases lapse
meanwhile and another worker takes its work, so the thawed process must find itself fenced;
``bare_worker`` replaces one worker by one started bare (``celery -A tasks worker -n NAME@%h``,
no -Q, no pool options: it must serve every queue); ``legacy_backlog`` adds, beside the trial's
parents, a backlog of pre-upgrade RUNNING executions two days old, more than one scan batch,
that must all be delivered as timed out, once. ``stall`` SIGSTOPs one worker (its pool
included) mid-trial for two to three leases, then SIGCONT: a process paused with its connections
open, inside a transaction or not; the server ends its idle transactions, the scan never waits
on its rows, and the thawed process finds itself fenced. ``freeze`` freezes ONE live worker's
PostgreSQL connection (the proxy holds its bytes both ways, no reset: the TCP connection stays
up) when it next carries one of a few statements (the pending round's INSERT, a message's
INSERT, an execution's UPDATE, a COMMIT): the process lives on and only that call waits; the
trial must come to rest while the connection is still frozen (the stuck holder's lease is
renewed no more and lapses, the scan takes the work back), then the connection is thawed and
the stuck call's late writes must change nothing. ``deploy`` restarts the workers one by one
on a changed configuration (another system prompt for every agent, docs/releases.md), a rolling
deploy mid-trial; the next ``deploy`` goes back to the first configuration (a rollback, which
finds its old release). The workers use a private redis-server and reach PostgreSQL through the
proxy; the soak itself talks to both directly.

After every trial, besides the invariants: each session's model requests all carried one
release's system prompt (sessions are pinned; the soak moves none). The soak's model marks each
tool-call reply with a token, so a later request of the same session (which carries that reply
back) is traced to the session's first request.

Budgets: a share of the parents (``--budget-fraction``, default 0.5) get a token budget drawn
between BUDGET_RANGE (every model reply reports USAGE; each call reserves its prompt's estimate
plus ``max_tokens`` = 400), small enough that many such trees run out mid-way, with parallel
children reserving at once. After each trial, per budgeted tree: its books equal its stored
usage exactly (spent = the provider's figures of its stored replies), and spent + reserved +
estimated is within its budget (each reply's figure is within its reservation, so the model
served the tree no more than its budget: a lost reply is charged its reservation as estimated);
every session ends and every result is delivered once (I1-I7, as for every tree).

``--faults stall,kill_one`` draws from those kinds only. SIGTERM or SIGINT (a timeout, ^C)
stops every process the soak started (a stopped worker is sent SIGCONT first) and drops its
database before it exits.

Prints one line per failed trial with its seed (re-run it alone with --trials 1 --seed S),
a progress line every 10 trials, and ends with `N passed, M failed`. Exit code 1 on failure.
Needs PostgreSQL and Redis (like the test suite); it creates and drops its own database.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Clear of the test suite's databases: `make test` (3 xdist workers) uses 7-15, the benches 4-6.
os.environ.setdefault("STACK_REDIS_DBS", "1,2,3")

from doubles.scripted_model import ScriptedModelServer  # noqa: E402  (after the path above)

PG_ADMIN = os.environ.get("SOAK_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")
SHAPES = ("one", "two", "mixed", "three")
FAULTS = (
    "kill_one",
    "kill_in_recovery",
    "redis_restart",
    "pg_cuts",
    "freeze_scanner",
    "bare_worker",
    "legacy_backlog",
    "stall",
    "freeze",
    "deploy",
)
#: What the ``freeze`` fault waits for on a worker's connection (one drawn per trial).
FREEZE_ON = (b"INSERT INTO pending_round", b"INSERT INTO message", b"UPDATE subagent_execution", b"COMMIT")
#: How long a trial under ``freeze`` may take to come to rest with the connection still frozen.
FROZEN_REST_SECONDS = 90.0
#: The default agents, with the soak's tools (bench/soak_tools.py) allowed to the children.
AGENTS_TOML = """
[agents.main]
system_prompt = "You are the main agent. Delegate work to subagents with the delegate tool and combine results."
max_rounds = 20
max_tokens = 400

[agents.reviewer]
system_prompt = "You are the reviewer subagent."
tools = ["echo", "wait", "charge", "stamp"]
max_rounds = 10
max_tokens = 400

[agents.researcher]
system_prompt = "You are the researcher subagent."
tools = ["echo", "wait", "charge", "stamp"]
max_rounds = 10
max_tokens = 400
"""
#: The ``deploy`` fault's other configuration: every agent's prompt changed (the script's rules
#: still match: they test "main agent" and "subagent").
DEPLOYED_TOML = AGENTS_TOML.replace("agent.", "agent (deployed).").replace("subagent.", "subagent (deployed).")
#: What every model reply of the soak reports it cost (each call's reservation is above it).
USAGE = {"prompt_tokens": 300, "completion_tokens": 50}
#: The token budgets drawn for budgeted trees: a tree of three children spends up to ~3,900.
BUDGET_RANGE = (1500, 6000)
#: Executions of the ``legacy_backlog`` fault: above one scan batch (recovery.scan.BATCH, 5,000
#: today: a backlog of 5,005).
LEGACY_PER_PARENT = 5


def legacy_parents() -> int:
    from recovery.scan import BATCH

    return BATCH // LEGACY_PER_PARENT + 1


def script() -> list[dict[str, Any]]:
    def d(agent: str, task: str) -> dict[str, Any]:
        return {"name": "delegate", "arguments": {"agent_type": agent, "task": task}}

    calls = {
        "one": [d("reviewer", "r1")],
        "two": [d("reviewer", "r1"), d("researcher", "s1")],
        "mixed": [d("reviewer", "r1"), {"name": "echo", "arguments": {"text": "inline"}}, d("researcher", "s1")],
        "three": [d("reviewer", "r1"), d("reviewer", "r2"), d("researcher", "s1")],
    }
    rules: list[dict[str, Any]] = [
        # A pre-upgrade parent resumed after its (timed out) children were delivered.
        {"when": {"system_contains": "main agent", "user_contains": "[legacy]"}, "reply": {"content": "final answer"}}
    ]
    for shape, tool_calls in calls.items():
        rules.append(
            {
                "when": {"system_contains": "main agent", "user_contains": f"[{shape}]", "turn": 0},
                "reply": {"tool_calls": per_reply_ids(tool_calls)},
            }
        )
    rules += [
        {"when": {"system_contains": "main agent", "turn": 1}, "reply": {"content": "final answer"}},
        {
            # Python tools of both kinds (bench/soak_tools.py), then a wait: the faults land
            # inside the round as often as between rounds.
            "when": {"system_contains": "subagent", "last_role": "user"},
            "reply": {
                "tool_calls": per_reply_ids(
                    [
                        {"name": "charge", "arguments": {"amount_cents": 250}},
                        {"name": "stamp", "arguments": {"text": "receipt"}},
                        {"name": "wait", "arguments": {"seconds": 1}},
                    ]
                )
            },
        },
        {
            # A second charge as ``call_0`` again: a new call, with a new key (a reused key is
            # a charge the service would drop, counted by _charged_twice).
            "when": {"system_contains": "subagent", "last_role": "tool", "turn": 1},
            "reply": {"tool_calls": per_reply_ids([{"name": "charge", "arguments": {"amount_cents": 100}}])},
        },
        {"when": {"system_contains": "subagent", "last_role": "tool"}, "reply": {"content": "child answer"}},
    ]
    for rule in rules:
        rule["reply"]["usage"] = USAGE
    return rules


REPLY_TOKEN = re.compile(r"^\[reply (\d+)\]$")


class TracingModel(ScriptedModelServer):
    """The scripted model with a trace: each request's system prompt and the session it belongs
    to. A tool-call reply gets the content ``[reply N]``; a later request of the same session
    carries it back, and the first such token in a request names the session's first request."""

    def __init__(self, script: Any) -> None:
        super().__init__(script)
        self.trace_lock = threading.Lock()
        #: (the session's first reply token, the system prompt) per answered request
        self.trace: list[tuple[int, str]] = []
        self.replies = 0

    def answer(self, body: Any, authorization: str | None) -> tuple[int, dict[str, Any]]:
        status, payload = super().answer(body, authorization)
        if status != 200 or not isinstance(body, dict):
            return status, payload
        messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
        system = next((str(m.get("content")) for m in messages if m.get("role") == "system"), "")
        carried = [
            int(found.group(1))
            for m in messages
            if m.get("role") == "assistant" and isinstance(m.get("content"), str)
            for found in [REPLY_TOKEN.match(m["content"])]
            if found
        ]
        message = payload["choices"][0]["message"]
        with self.trace_lock:
            own = None
            if message.get("tool_calls"):
                self.replies += 1
                own = self.replies
                message["content"] = f"[reply {own}]"
            key = carried[0] if carried else own
            if key is not None:  # a session's only request, answered in words: nothing to compare
                self.trace.append((key, system))
        return status, payload


def mixed_prompts(trace: list[tuple[int, str]]) -> list[str]:
    """Sessions (by their first request's reply token) whose requests carried more than one
    system prompt: a pinned session must keep its release's."""
    prompts: dict[int, set[str]] = {}
    for key, system in trace:
        prompts.setdefault(key, set()).add(system)
    return [
        f"a session's model requests carried {len(p)} prompts: {sorted(s[:40] for s in p)}"
        for key, p in prompts.items()
        if len(p) > 1
    ]


def per_reply_ids(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls as providers number them, per reply: ``call_0``, ``call_1``, ... in every reply
    (the soak's model reuses ``call_0`` in every tool-call reply of a session)."""
    return [{**c, "id": f"call_{i}"} for i, c in enumerate(calls)]


class Soak:
    def __init__(self, workers: int, log_dir: Path, *, pool: str = "prefork", concurrency: int = 2) -> None:
        from sqlalchemy import create_engine, text

        #: Celery's -P and -c of every worker the soak starts (``--pool``, ``--concurrency``),
        #: except the ``bare_worker`` fault's, which is bare.
        self.pool, self.concurrency = pool, concurrency

        from tests.faultproxy import FaultProxy
        from tests.services import RedisServer

        self.db_name = f"soak_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.db_name}"'))
        self.url = PG_ADMIN.rsplit("/", 1)[0] + "/" + self.db_name
        from devstack.processes import apply_env, flush_broker, service_env
        from migrations import upgrade

        upgrade(self.url)
        self.tool_log = log_dir / "charges.log"
        agents = log_dir / "agents.toml"
        agents.write_text(AGENTS_TOML)
        os.environ.update(AGENTS_FILE=str(agents), TOOL_MODULES="bench.soak_tools", SOAK_TOOL_LOG=str(self.tool_log))
        self.redis = RedisServer(log_dir).start()
        self.proxy = FaultProxy.for_url(self.url).start()
        self.model = TracingModel(script())
        #: The two configurations ``deploy`` switches between, and the one the workers run.
        self.agents_files = (agents, log_dir / "agents-deployed.toml")
        self.agents_files[1].write_text(DEPLOYED_TOML)
        self.deployed = 0
        #: ``deploy`` trials, and sessions whose requests mixed prompts (the trace check).
        self.deploys = 0
        #: Sessions with two model requests or more whose prompts were compared (the last check
        #: of each trial counts).
        self.traced = self.traced_trial = 0
        self.env = service_env(self.url, self.model.start(), redis_base=self.redis.url, broker="redis")
        apply_env(self.env)
        self.worker_env = {**self.env, "DATABASE_URL": self.proxy.rewrite(self.url)}
        flush_broker(self.redis.url, broker="redis")
        self.log_dir = log_dir
        self.n_workers = max(2, workers)  # "one of several": a fault never takes every worker
        self.workers: list[Any] = []
        self.counter = 0
        self.mix: dict[str, int] = dict.fromkeys(FAULTS, 0)
        self.faults: tuple[str, ...] = FAULTS
        self.budget_fraction = 0.5  #: share of the parents given a token budget (--budget-fraction)
        self.budgets = {"trees": 0, "stopped_sessions": 0}  #: over the trials that passed
        #: Process groups this soak SIGSTOPped and has not resumed yet.
        self.stopped: set[int] = set()
        #: Every worker this soak started, replaced ones included (their pools may outlive them).
        self.started: list[Any] = []
        #: What a fault itself saw go wrong this trial (``freeze``: no rest while frozen).
        self.fault_problems: list[str] = []
        self._frozen_before = 0  #: the proxy's count of frozen connections before this trial's
        self._freeze_on = FREEZE_ON[0]  #: what this ``freeze`` trial waits for
        #: ``freeze`` trials by what froze (the statement), or "nothing" (the work went past it).
        self.froze: dict[str, int] = {}

    def worker(self, beat: bool = False, name: str | None = None, bare: bool = False) -> Any:
        from devstack.processes import Worker

        if name is None:
            self.counter += 1
            name = f"s{self.counter}"
        argv = ["-A", "tasks", "worker", "-n", f"{name}@%h"] if bare else None
        w = Worker(
            self.worker_env, self.log_dir, name=name, concurrency=self.concurrency, beat=beat, argv=argv, pool=self.pool
        )
        self.started.append(w)  # before it starts: a signal may arrive while it boots
        w.start()
        self.workers.append(w)
        return w

    def ensure_workers(self, rng: random.Random | None = None, dead: list[Any] | None = None) -> None:
        """Replace dead workers: under their own name half the time (the supervisor restarts
        it; boot generation), else a new worker takes its place (leases lapse)."""
        self.workers = [w for w in self.workers if not w.exited]
        names = [w.name for w in dead or []]
        has_beat = any(w.beat for w in self.workers)
        while len(self.workers) < self.n_workers:
            same = names.pop() if names and rng is not None and rng.random() < 0.5 else None
            self.worker(beat=not has_beat, name=same)
            has_beat = True

    def reset(self) -> None:
        """Empty the tables between trials. Ids are NOT restarted: a stale message of an earlier
        trial (a duplicate callback, a late scan) must find no row, never a new trial's row."""
        from sqlalchemy import text
        from sqlalchemy.exc import OperationalError

        from devstack.processes import flush_broker
        from models import get_engine

        self.proxy.clear()
        self.proxy.thaw()
        self.fault_problems = []
        self.traced, self.traced_trial = self.traced + self.traced_trial, 0
        with self.model.trace_lock:
            self.model.trace.clear()
        flush_broker(self.redis.url, broker="redis")
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
        from harness.views import create_session

        rng = random.Random(seed)
        fault = rng.choice(self.faults)
        self.mix[fault] += 1
        self.reset()
        self.ensure_workers()
        if fault == "freeze":  # armed before the work starts: a parent's first round can freeze too
            self._freeze_on = rng.choice(FREEZE_ON)
            self.proxy.freeze_on(self._freeze_on)
        parents = []
        for _ in range(rng.randint(1, 3)):
            shape = rng.choice(SHAPES)
            budget = rng.randint(*BUDGET_RANGE) if rng.random() < self.budget_fraction else None
            sid = create_session("main", f"work [{shape}]", budget_tokens=budget)
            tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
            parents.append(sid)
        time.sleep(rng.uniform(0.1, 2.5))
        getattr(self, fault)(rng)
        # A legacy backlog is five thousand recoveries more: on a loaded 2-core machine, minutes.
        deadline = time.monotonic() + (900 if fault == "legacy_backlog" else 240)
        while time.monotonic() < deadline:
            # NOTE: the whole-database check loads every row; run every 0.25 s while thousands
            # of executions were still settling it took half of the machine's two cores from
            # the workers it waits for (the legacy backlog then missed its 15 minutes). Three
            # index reads say when it is worth running.
            if not _not_at_rest():
                problems = self.fault_problems + self._problems(fault)
                if not problems:
                    self._tally_budgets()
                    return []
            time.sleep(0.25)
        problems = self.fault_problems + self._problems(fault)
        return [f"fault={fault}", *problems[:5]] if problems else []

    def _problems(self, fault: str) -> list[str]:
        from sqlalchemy import text

        from models import transaction
        from recovery.invariants import check_all

        with transaction() as s:
            # NOTE: the check reads the whole database in one transaction, on a connection that
            # carries the workers' idle-in-transaction bound (a few seconds at the soak's
            # 3 s lease). On a machine loaded far past its cores (load average 25 on 2), the
            # check's own Python time between two statements passed it and the server ended the
            # soak, not a trial. It is the soak's reading, not a worker's: no bound.
            s.execute(text("SET LOCAL idle_in_transaction_session_timeout = 0"))
            problems = check_all(s, settled=True) + self._charged_twice() + self._prompts_mixed(s) + _budget_problems(s)
            if not problems and fault == "legacy_backlog":
                problems = _legacy_problems(s)
        return problems

    def _prompts_mixed(self, s: Any) -> list[str]:
        """Every session's requests carried one release's prompt (the soak moves no session:
        a move, by the default pinned policy, is a problem too)."""
        from collections import Counter

        from sqlalchemy import func, select

        from models import ReleaseMove

        with self.model.trace_lock:
            trace = list(self.model.trace)
        self.traced_trial = sum(1 for n in Counter(key for key, _ in trace).values() if n > 1)
        moved = s.execute(select(func.count()).select_from(ReleaseMove)).scalar_one()
        return mixed_prompts(trace) + ([f"{moved} release moves under the pinned policy"] if moved else [])

    def _tally_budgets(self) -> None:
        """Count the trial's budgeted trees and the sessions its budgets stopped (printed at the
        end: a soak whose budgets never ran out checked little)."""
        from sqlalchemy import text

        from models import transaction

        with transaction() as s:
            trees, stopped = s.execute(
                text(
                    "SELECT (SELECT count(*) FROM tree_budget),"
                    " (SELECT count(*) FROM agent_session WHERE failure_code = 'budget_exhausted')"
                )
            ).one()
        self.budgets["trees"] += int(trees)
        self.budgets["stopped_sessions"] += int(stopped)

    def _charged_twice(self) -> list[str]:
        """The at-most-once rule seen from the side effect itself: every ``charge`` call wrote
        its key once at most (the file is kept across trials: keys are unique per call)."""
        from collections import Counter

        if not self.tool_log.exists():
            return []
        counts = Counter(self.tool_log.read_text().split())
        return [f"charge {key[:12]} ran {n} times" for key, n in counts.items() if n > 1]

    def _kill(self, victim: Any, rng: random.Random) -> None:
        victim.kill()
        self.ensure_workers(rng, [victim])

    def kill_one(self, rng: random.Random) -> None:
        self._kill(rng.choice(self.workers), rng)

    def kill_in_recovery(self, rng: random.Random) -> None:
        from sqlalchemy import select

        from models import SubagentExecution, transaction

        self._kill(rng.choice(self.workers), rng)
        end = time.monotonic() + 15
        while time.monotonic() < end:  # the worker that is recovering the work dies too
            with transaction() as s:
                owners = (
                    s.execute(
                        select(SubagentExecution.lease_owner).where(
                            SubagentExecution.status == "RECOVERING", SubagentExecution.lease_owner.is_not(None)
                        )
                    )
                    .scalars()
                    .all()
                )
            victims = [w for w in self.workers if any(o and o.startswith(f"{w.name}@") for o in owners)]
            if victims:
                time.sleep(rng.uniform(0.0, 0.5))
                self._kill(rng.choice(victims), rng)
                return
            time.sleep(0.1)

    def redis_restart(self, rng: random.Random) -> None:
        self.redis.restart(down_seconds=rng.uniform(0.2, 3.0))  # started again EMPTY
        self.ensure_workers(rng)

    def stall(self, rng: random.Random) -> None:
        """SIGSTOP one worker for two to three leases, then SIGCONT."""
        import signal

        from models import lease

        victim = rng.choice(self.workers)
        assert victim.proc is not None
        self.stopped.add(victim.proc.pid)
        os.killpg(victim.proc.pid, signal.SIGSTOP)
        time.sleep(rng.uniform(2.0, 3.0) * lease.lease_seconds())
        os.killpg(victim.proc.pid, signal.SIGCONT)
        self.stopped.discard(victim.proc.pid)

    def freeze(self, rng: random.Random) -> None:
        """The worker connection that next carries the statement drawn from ``FREEZE_ON``
        (armed when the trial began) freezes: wait for the trial to come to rest while it is
        frozen, then thaw it and let the late writes of its call arrive (the trial's checks
        follow)."""
        pattern = self._freeze_on
        end = time.monotonic() + 15
        while self.proxy.stats().frozen == self._frozen_before and time.monotonic() < end:
            time.sleep(0.05)
        if self.proxy.stats().frozen == self._frozen_before:  # the work went past it: nothing froze
            self.proxy.clear()
            self.froze["nothing"] = self.froze.get("nothing", 0) + 1
            return
        self._frozen_before = self.proxy.stats().frozen
        self.froze[pattern.decode()] = self.froze.get(pattern.decode(), 0) + 1
        end = time.monotonic() + FROZEN_REST_SECONDS
        while _not_at_rest() and time.monotonic() < end:
            time.sleep(0.25)
        if _not_at_rest():
            self.fault_problems.append(
                f"not at rest {FROZEN_REST_SECONDS:.0f}s after a connection froze on {pattern.decode()!r}"
            )
        self.proxy.thaw()

    def freeze_scanner(self, rng: random.Random) -> None:
        import signal

        from settings import get_settings

        victim = rng.choice(self.workers)
        assert victim.proc is not None
        self.stopped.add(victim.proc.pid)
        os.killpg(victim.proc.pid, signal.SIGSTOP)
        time.sleep(3 * get_settings().SCAN_INTERVAL_SECONDS)
        os.killpg(victim.proc.pid, signal.SIGCONT)
        self.stopped.discard(victim.proc.pid)

    def bare_worker(self, rng: random.Random) -> None:
        victim = rng.choice([w for w in self.workers if not w.beat] or self.workers)
        victim.kill()
        self.workers = [w for w in self.workers if w is not victim]
        self.worker(beat=victim.beat, bare=True)

    def legacy_backlog(self, rng: random.Random) -> None:
        """Rows as migration 0002 leaves pre-upgrade RUNNING work: PENDING, no invocation type,
        no tool call id, no lease, started two days ago (past deadline + grace)."""
        from datetime import timedelta

        from sqlalchemy import insert

        from models import AgentSession, Message, SubagentExecution, transaction
        from models.base import utcnow

        old = utcnow() - timedelta(days=2)
        with transaction() as s:
            for _ in range(legacy_parents()):
                parent = AgentSession(
                    user_id="u1",
                    session_type="NORMAL",
                    agent_type="main",
                    phase="RUNNING",
                    started_at=old,
                    updated_at=old,
                )
                s.add(parent)
                s.flush()
                s.execute(
                    insert(Message).values(session_id=parent.id, role="USER", content="work [legacy]", created_at=old)
                )
                for i in range(LEGACY_PER_PARENT):
                    child = AgentSession(
                        user_id="u1",
                        session_type="SUBAGENT",
                        parent_session_id=parent.id,
                        agent_type="reviewer",
                        phase="RUNNING",
                        started_at=old,
                        updated_at=old,
                    )
                    s.add(child)
                    s.flush()
                    s.execute(insert(Message).values(session_id=child.id, role="USER", content=f"r{i}", created_at=old))
                    s.execute(
                        insert(SubagentExecution).values(
                            parent_session_id=parent.id,
                            child_session_id=child.id,
                            agent_type="reviewer",
                            task_description=f"r{i}",
                            status="RUNNING",
                            delivery_status="PENDING",
                            started_at=old,
                        )
                    )

    def deploy(self, rng: random.Random) -> None:
        """A rolling deploy mid-trial: each worker in turn is stopped (SIGTERM: Celery's warm
        shutdown, killed after 10 s) and replaced by one that reads the other configuration,
        under its own name half the time; old and new run side by side in between."""
        self.deploys += 1
        self.deployed = 1 - self.deployed
        self.worker_env = {**self.worker_env, "AGENTS_FILE": str(self.agents_files[self.deployed])}
        for victim in list(self.workers):
            time.sleep(rng.uniform(0.0, 1.0))
            victim.stop()
            self.workers = [w for w in self.workers if w is not victim]
            self.worker(beat=victim.beat, name=victim.name if rng.random() < 0.5 else None)

    def pg_cuts(self, rng: random.Random) -> None:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            self.proxy.cut_all()
            time.sleep(0.3)

    def close(self) -> None:
        """Stop every process this soak started (workers it SIGSTOPped are resumed first, so
        that they can stop) and drop its database."""
        import signal

        from sqlalchemy import text

        for pgid in list(self.stopped):
            try:
                os.killpg(pgid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stopped.clear()
        for w in self.started:
            w.stop()
        for w in self.started:  # a pool process whose worker died (or was replaced) lives on in its group
            try:
                if w.proc is not None:
                    os.killpg(w.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.model.stop()
        self.proxy.stop()
        self.redis.stop()
        from models import dispose_engines

        dispose_engines()
        with self.admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))


def _not_at_rest() -> bool:
    """What ``check_all(settled=True)`` requires first, read from three indexes: an execution
    still PENDING, a session RUNNING or RESUMING, a round still open."""
    from sqlalchemy import text

    from models import transaction

    with transaction() as s:
        row = s.execute(
            text(
                "SELECT EXISTS (SELECT 1 FROM subagent_execution WHERE delivery_status = 'PENDING')"
                " OR EXISTS (SELECT 1 FROM agent_session WHERE phase IN ('RUNNING', 'RESUMING'))"
                " OR EXISTS (SELECT 1 FROM pending_round WHERE closed_at IS NULL)"
            )
        ).scalar_one()
    return bool(row)


def _budget_problems(s: Any) -> list[str]:
    """Per budgeted tree at rest: spent equals its stored replies' figures exactly, and spent +
    reserved + estimated is within its budget (so the model served it no more: each reply's
    figure is within its call's reservation, a lost reply charged as that reservation)."""
    from sqlalchemy import select

    from models.budget import TreeBudget
    from models.usage import tree_usage

    problems = []
    for b in s.execute(select(TreeBudget)).scalars():
        used = tree_usage(s, b.root_session_id)
        stored = used.prompt_tokens + used.completion_tokens
        if stored != b.spent_tokens:
            problems.append(f"tree {b.root_session_id}: spent {b.spent_tokens} != stored usage {stored}")
        charged = b.spent_tokens + b.reserved_tokens + b.estimated_tokens
        if b.budget_tokens is not None and charged > b.budget_tokens:
            problems.append(f"tree {b.root_session_id}: charged {charged} > budget {b.budget_tokens}")
        if used.estimated_tokens != b.estimated_tokens:
            problems.append(f"tree {b.root_session_id}: estimated {b.estimated_tokens} != {used.estimated_tokens}")
    return problems


def _legacy_problems(s: Any) -> list[str]:
    """Every execution of the legacy backlog ended FAILED as timed out (and, by I1, once)."""
    from datetime import timedelta

    from sqlalchemy import func, select

    from models import SubagentExecution as E
    from models.base import utcnow

    old = E.started_at < utcnow() - timedelta(days=1)
    total = s.execute(select(func.count()).where(old)).scalar_one()
    timed_out = s.execute(
        select(func.count()).where(old, E.status == "FAILED", E.error.contains("timed out"))
    ).scalar_one()
    if total != legacy_parents() * LEGACY_PER_PARENT or timed_out != total:
        return [f"legacy backlog: {timed_out} of {total} executions ended as timed out"]
    return []


class Stopped(SystemExit):
    """SIGTERM or SIGINT reached the soak: it unwinds through its clean-up and exits."""


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT end the soak through its ``finally`` (every process it started is
    stopped), instead of leaving its workers running: they run in sessions of their own, so a
    signal sent to the soak alone never reaches them."""
    import signal

    def stop(signum: int, _frame: Any) -> None:
        raise Stopped(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def _ignore_signals() -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument(
        "--pool",
        choices=("prefork", "threads"),
        default="prefork",
        help="Celery's -P of the soak's workers (prefork; threads is the Procfile's for the agent loops)",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="Celery's -c of the soak's workers (2)")
    parser.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated fault kinds to draw from (default: all: {FAULTS})"
    )
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.5,
        help="share of the parents given a token budget drawn from BUDGET_RANGE (0: none)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.budget_fraction <= 1:
        parser.error("--budget-fraction must be between 0 and 1")
    if args.trials < 1 or args.workers < 1 or args.concurrency < 1:
        parser.error("--trials, --workers and --concurrency must be positive")
    faults = tuple(f for f in args.faults.split(",") if f)
    if not faults or any(f not in FAULTS for f in faults):
        parser.error(f"--faults: choose among {', '.join(FAULTS)}")
    _stop_on_signals()
    log_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    print(f"soak: pid {os.getpid()}, workers -P {args.pool} -c {args.concurrency}, logs in {log_dir}", flush=True)
    soak: Soak | None = None
    passed = failed = 0
    started = time.monotonic()
    try:
        soak = Soak(args.workers, log_dir, pool=args.pool, concurrency=args.concurrency)
        soak.faults = faults
        soak.budget_fraction = args.budget_fraction
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
        _ignore_signals()  # a second SIGTERM must not cut the clean-up short
        if soak is not None:
            soak.close()
    mix = ", ".join(f"{k}={v}" for k, v in soak.mix.items())
    print(f"soak: {args.trials} trials in {time.monotonic() - started:.0f}s; faults: {mix} (logs in {log_dir})")
    if soak.deploys:
        print(f"deploy: {soak.deploys} rolling deploys")
    print(f"prompts: {soak.traced + soak.traced_trial} sessions' requests compared (one release's prompt each)")
    if soak.froze:
        print("freeze: " + ", ".join(f"{k!r}={v}" for k, v in sorted(soak.froze.items())))
    trees, stopped = soak.budgets["trees"], soak.budgets["stopped_sessions"]
    print(f"budgets: {trees} budgeted trees, {stopped} sessions stopped by them")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
