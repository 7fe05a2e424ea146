"""Model calls per recovered round: ``python bench/journal.py [--parents P] [--wait-seconds S]``.

The round journal (docs/invariants.md, J2): a crash inside a round must not pay for the same model answer twice.

1. Crash: one real prefork worker runs P parents; each delegates one child; each child's
   model answers with one tool call (``wait S``) and the child runs it. Once the model has
   answered every child (every child's reply is in hand, and after a short settle every
   child is inside its tool), the worker is SIGKILLed and the broker flushed.
2. Recover: a fresh worker starts, the leases are expired (the time a real restart waits) and
   ``recovery.scan`` is sent; timed until every parent has its final answer.

Prints the interrupted rounds, how many times the model was asked for the children's
tool-call reply in all (P when no reply is asked again), and the model calls per recovered
round: before the round journal 1 (the round was thrown away and the model asked again),
with it 0 (the journaled reply is continued). Checks the invariants over the whole database.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

MAIN = "main agent"
#: The script rule of the children's tool-call reply (the one that must not be asked again).
CHILD_TOOL_RULE = 2


def script(wait_seconds: float) -> list[dict[str, Any]]:
    return [
        {
            "when": {"system_contains": MAIN, "turn": 0},
            "reply": {"tool_calls": [{"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "{user}"}}]},
        },
        {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "final answer"}},
        {
            "when": {"system_contains": "subagent", "last_role": "user"},
            "reply": {"tool_calls": [{"name": "wait", "arguments": {"seconds": wait_seconds}}]},
        },
        {"when": {"system_contains": "subagent", "last_role": "tool"}, "reply": {"content": "child answer"}},
    ]


def _parents_done(parents: int) -> int:
    from sqlalchemy import func, select

    from models import AgentSession, Phase, SessionType, transaction

    with transaction() as s:
        return int(
            s.execute(
                select(func.count()).where(
                    AgentSession.session_type == SessionType.NORMAL, AgentSession.phase == Phase.WAITING_USER
                )
            ).scalar_one()
        )


def run(url: str, *, parents: int, wait_seconds: float, settle_seconds: float) -> dict[str, Any]:
    import tasks
    from bench._common import Stack, bench_env, flush_redis, progress, wait_for
    from bench.recovery import _expire_leases
    from devstack.processes import apply_env
    from harness.views import create_session
    from models import transaction
    from recovery.invariants import check_all

    flush_redis()
    with Stack("bench-journal") as stack:
        model = stack.model(script(wait_seconds))
        env = bench_env(url, model.base_url, LEASE_SECONDS="120")
        apply_env(env)
        for i in range(parents):
            sid = create_session("main", f"job {i}")
            tasks.app.signature("agent.run", args=(sid, 0)).apply_async()
        doomed = stack.worker(env, "crash", concurrency=max(2, parents))

        def asked() -> int:
            return sum(1 for j in model.journal() if j["rule"] == CHILD_TOOL_RULE)

        wait_for(lambda: asked() >= parents, timeout=60 + parents, what="every child's tool-call reply")
        time.sleep(settle_seconds)  # the replies are journaled and the tools started
        before_crash = asked()
        doomed.kill()
        flush_redis()
        progress(f"worker SIGKILLed with {parents} children inside their round; broker flushed")

        fresh = stack.worker(env, "r1", concurrency=2)
        wait_for(lambda: "event=subagent_recovery_scan" in fresh.log(), timeout=30, what="the boot scan")
        _expire_leases()
        t0 = time.monotonic()
        tasks.app.signature("recovery.scan").apply_async()
        try:
            wait_for(lambda: _parents_done(parents) == parents, timeout=120 + 10 * parents, what="every parent")
        except Exception:
            stack.failed = True
            stack.dump_logs()
            raise
        elapsed = time.monotonic() - t0
        total = asked()
        with transaction() as s:
            problems = check_all(s, settled=True)
    return {
        "interrupted": before_crash,
        "asked": total,
        "per_round": (total - before_crash) / before_crash if before_crash else 0.0,
        "seconds": elapsed,
        "problems": problems,
    }


def inline_script(rounds: int) -> list[dict[str, Any]]:
    """A parent of ``rounds`` inline rounds (two ``echo`` calls each), then its answer."""
    calls = [{"name": "echo", "arguments": {"text": "a"}}, {"name": "echo", "arguments": {"text": "b"}}]
    rules: list[dict[str, Any]] = [
        {"when": {"system_contains": MAIN, "turn": n}, "reply": {"tool_calls": calls}} for n in range(rounds)
    ]
    rules.append({"when": {"system_contains": MAIN, "turn": rounds}, "reply": {"content": "done"}})
    return rules


class _NoChildren:
    def start_children(self, parent_id: int, parent_epoch: int, children: Any) -> None:
        raise AssertionError("inline rounds only")

    def resume_parent(self, parent_id: int, epoch: int) -> None:
        raise AssertionError("inline rounds only")


def normal_path(url: str, *, sessions: int, rounds: int) -> list[float]:
    """Milliseconds per inline round (model call + two tools + every commit), one per session,
    run in this process against the instant scripted model: what the journal adds (the reply's
    commit and the first tool's result) is inside, and nothing else differs before/after."""
    from doubles.scripted_model import ScriptedModelServer
    from harness.loop import LoopDeps
    from harness.model import ModelClient
    from harness.parent import run_agent
    from harness.views import create_session
    from settings import get_settings

    per_round: list[float] = []
    with ScriptedModelServer(inline_script(rounds)) as model:
        cfg = get_settings()
        client = ModelClient(model.base_url, "bench", cfg.MODEL_NAME, 5.0, 30.0)
        deps = LoopDeps(scheduler=_NoChildren(), model=client, owner="bench", lease_seconds=30.0)
        for _ in range(sessions + 1):
            sid = create_session("main", "go")
            t0 = time.perf_counter()
            outcome = run_agent(sid, 0, deps)
            if outcome != "waiting_user":
                raise RuntimeError(f"the parent ended {outcome}")
            per_round.append((time.perf_counter() - t0) * 1000 / (rounds + 1))
    return per_round[1:]  # the first session warms the connections


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/journal.py", description=__doc__.split("\n")[0])
    parser.add_argument("--parents", type=int, default=4, help="parents, one child each (default 4)")
    parser.add_argument("--wait-seconds", type=float, default=4.0, help="the children's tool duration (4)")
    parser.add_argument("--settle-seconds", type=float, default=1.0, help="after the last reply, before the kill (1)")
    parser.add_argument(
        "--normal-path",
        action="store_true",
        help="instead: ms per inline round on the normal path (no crash), the journal's cost",
    )
    args = parser.parse_args(argv)
    from bench._common import bench_database, percentile

    if args.normal_path:
        with bench_database("bench_journal") as url:
            ms = normal_path(url, sessions=20, rounds=10)
        print(
            f"normal path, ms per inline round (2 echo tools, instant model, in-process): "
            f"p50 {percentile(ms, 50):.1f}  p90 {percentile(ms, 90):.1f}  ({len(ms)} sessions x 11 rounds)"
        )
        return 0
    with bench_database("bench_journal") as url:
        fig = run(url, parents=args.parents, wait_seconds=args.wait_seconds, settle_seconds=args.settle_seconds)
    print(f"rounds interrupted by the kill:           {fig['interrupted']}  (one child round each)")
    print(f"children's tool-call reply asked in all:  {fig['asked']}  (no re-ask: {fig['interrupted']})")
    print(f"model calls per recovered round:          {fig['per_round']:.2f}  (goal 0 when the reply was journaled)")
    print(
        f"scan -> every parent answered:            {fig['seconds']:.1f} s"
        f"  (includes re-run {args.wait_seconds:g} s tools)"
    )
    if fig["problems"]:
        print(f"invariants: VIOLATED ({len(fig['problems'])})")
        for problem in fig["problems"]:
            print(f"  {problem}")
        return 1
    print("invariants: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
