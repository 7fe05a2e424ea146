"""Where the milliseconds go: ``python bench/profile.py [--repeat N] [--children K]``.

Profiles (pyinstrument, the ``profile`` extra: ``pip install -e ".[profile]"``), in this one
process, on a throwaway database with a scripted model that answers at once:

- a normal delegating round: ``run_agent`` (the parent asks the model and yields its round)
  -> ``start_child`` per child (the last one delivers the round) -> ``run_agent``
  (the parent's answer);
- a recovery: a parent yielded its round and "crashed" before any child ran (leases dated in
  the past, as after a crash; not profiled), then ``scan`` -> ``recover_child`` per execution
  -> ``deliver_and_resume`` -> ``run_agent``.

The scheduler records instead of enqueueing (tests.helpers.RecordingScheduler), so the broker
is not in the picture: what remains is our Python, SQLAlchemy, the PostgreSQL round trips,
the model's HTTP calls and the session_status events. ``--repeat`` rounds of each are profiled
(one parent each) and their sessions combined. Prints, for each: the wall time per round, the
time by kind (PostgreSQL round trips, SQLAlchemy, model HTTP, Redis, our code, other), the top
functions by self time, and our own functions by total time. ``--html DIR`` also writes
pyinstrument's full reports. ``--timed`` runs the same rounds without a profiler and compares,
in alternating blocks, the shipped Session with one that sends every statement through its ORM
path (see :func:`timed`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

INSTALL_HINT = 'pyinstrument is not installed: install with pip install -e ".[profile]"'
#: Self time in these SQLAlchemy functions is the wait for PostgreSQL (the driver is C code).
DB_WAIT = frozenset({"do_execute", "do_executemany", "do_commit", "do_rollback", "do_begin", "connect", "_execute"})
OUR_PACKAGES = ("models", "harness", "recovery", "tasks", "settings", "crashpoints", "logfmt", "celeryconfig")


def script(children: int) -> list[dict[str, Any]]:
    from bench.delegation import instant_script

    return instant_script(children)


# --- the two paths, driven in-process --------------------------------------------------------


def _drain(deps: Any) -> None:
    """Run what the recording scheduler holds until nothing is left (the broker's part)."""
    from harness.child import start_child
    from harness.delivery import deliver_and_resume
    from harness.parent import run_agent
    from recovery.child import recover_child

    sched = deps.scheduler
    while sched.pending():
        if sched.recoveries:
            _, _, children = sched.recoveries.pop(0)
            for eid, epoch in children:
                recover_child(eid, epoch, deps)
        elif sched.children:
            _, _, children = sched.children.pop(0)
            for eid, e in children:
                start_child(eid, e, deps)  # the last one delivers (no callback after them)
        elif sched.deliveries:
            parent, epoch = sched.deliveries.pop(0)
            deliver_and_resume(parent, epoch, sched)
        else:
            sid, epoch = sched.resumed.pop(0)
            run_agent(sid, epoch, deps)


def normal_round(deps: Any, n: int) -> Callable[[], None]:
    """Set up (not profiled): a new session. Returns the profiled part: the whole round."""
    from harness.views import create_session

    sid = create_session("main", f"round {n}: split the work")

    def run() -> None:
        deps.scheduler.resumed.append((sid, 0))
        _drain(deps)
        _check_answered(sid)

    return run


def recovery_round(deps: Any, n: int) -> Callable[[], None]:
    """Set up (not profiled): a parent yields its round, its children never run (the crash),
    every lease lapses. Returns the profiled part: scan -> ... -> the parent's answer."""
    from harness.parent import run_agent
    from harness.views import create_session
    from recovery.scan import scan
    from tests.helpers import expire_leases

    sid = create_session("main", f"crash {n}: split the work")
    if run_agent(sid, 0, deps) != "yielded":
        raise RuntimeError("the parent did not yield its round")
    deps.scheduler.children.clear()  # the crash: its children were never sent
    expire_leases()

    def run() -> None:
        report = scan(deps.scheduler, callback_grace_seconds=0)
        if not report.recovering:
            raise RuntimeError(f"the scan found nothing to recover: {report}")
        _drain(deps)
        _check_answered(sid)

    return run


def _check_answered(sid: int) -> None:
    from sqlalchemy import text

    from models import transaction

    with transaction() as s:
        phase = s.execute(text("SELECT phase FROM agent_session WHERE id = :i"), {"i": sid}).scalar_one()
    if phase != "WAITING_USER":
        raise RuntimeError(f"session {sid} ended {phase}, not WAITING_USER")


# --- reading the profile ---------------------------------------------------------------------


def _walk(frame: Any, real: Any = None, seen: frozenset[str] = frozenset()) -> Iterator[tuple[Any, Any, float, bool]]:
    """(frame, its nearest real ancestor-or-self, its own time, outermost of its function on the
    stack) for every frame. Own time = its time minus its children's, so they add up to the
    root's time exactly. Synthetic frames (``[self]``) and C functions (``<built-in>``) are
    judged by the nearest Python frame that called them."""
    is_real = not frame.is_synthetic and not (frame.file_path or "").startswith("<")
    real = frame if is_real or real is None else real
    key = _key(frame)
    own = frame.time - sum(child.time for child in frame.children)
    yield frame, real, max(own, 0.0), key not in seen
    for child in frame.children:
        yield from _walk(child, real, seen | {key})


def _key(frame: Any) -> str:
    return f"{frame.function}  ({frame.file_path_short}:{frame.line_no})"


def _self_key(frame: Any, real: Any) -> str:
    if frame.is_synthetic or frame is real:
        return _key(real)
    return f"{frame.function}  (called by {real.function}, {real.file_path_short}:{real.line_no})"


def _kind(frame: Any, real: Any) -> str:
    name = frame.function or ""
    path = (real.file_path or "").replace("\\", "/")
    if name.startswith(("connection.", "cursor.")) or "/psycopg2/" in path:
        return "PostgreSQL round trips"
    if "/sqlalchemy/" in path:
        return "PostgreSQL round trips" if real.function in DB_WAIT else "SQLAlchemy (Python)"
    if "/redis/" in path:
        return "Redis (session_status events)"
    if any(f"/{p}/" in path for p in ("requests", "urllib3", "http")) or path.endswith(("/socket.py", "/ssl.py")):
        return "model HTTP (requests)"
    if "/json/" in path:
        return "json"
    if _ours(real):
        return "our code (Python)"
    return "other Python"


def _ours(frame: Any) -> bool:
    from bench._common import ROOT

    path = frame.file_path or ""
    if not path.startswith(str(ROOT)) or "/.venv/" in path:
        return False
    return path[len(str(ROOT)) + 1 :].split("/")[0].removesuffix(".py") in OUR_PACKAGES


class Counts:
    """SQL statements, commits and connection checkouts (each one a pre-ping round trip when
    the pool pings) while ``counting``."""

    def __init__(self) -> None:
        from sqlalchemy import event
        from sqlalchemy.engine import Engine
        from sqlalchemy.pool import Pool

        self.counting = False
        self.values: dict[str, int] = defaultdict(int)

        def bump(name: str) -> Callable[..., None]:
            def on(*_: Any, **__: Any) -> None:
                if self.counting:
                    self.values[name] += 1

            return on

        event.listen(Engine, "before_cursor_execute", bump("statements"))
        event.listen(Engine, "commit", bump("commits"))
        event.listen(Pool, "checkout", bump("checkouts"))


@dataclass
class Profile:
    label: str
    rounds: list[float]
    session: Any
    counts: dict[str, int]

    def report(self, top: int) -> list[str]:
        root = self.session.root_frame()
        total = root.time if root is not None else 0.0
        by_kind: dict[str, float] = defaultdict(float)
        self_time: dict[str, float] = defaultdict(float)
        ours_total: dict[str, float] = defaultdict(float)
        for frame, real, own, outermost in _walk(root) if root is not None else ():
            if own:
                by_kind[_kind(frame, real)] += own
                self_time[_self_key(frame, real)] += own
            if outermost and frame is real and _ours(frame):
                ours_total[_key(frame)] += frame.time
        n = len(self.rounds)
        per = 1000.0 / n
        c = {k: self.counts.get(k, 0) / n for k in ("statements", "commits", "checkouts")}
        lines = [
            f"{self.label}: {n} rounds, wall p50 {statistics.median(self.rounds) * 1000:.1f} ms per round "
            f"(profiled {total * 1000:.0f} ms in all, {total * per:.1f} ms per round)",
            f"  per round: {c['statements']:.1f} SQL statements, {c['commits']:.1f} transactions committed, "
            f"{c['checkouts']:.1f} pool checkouts (each a pre-ping round trip when the pool pings)",
            "  time by kind (self time, ms per round):",
        ]
        for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {t * per:7.2f} ms  {100 * t / total:5.1f} %  {kind}")
        lines.append(f"  top {top} functions by self time (ms per round):")
        for key, t in sorted(self_time.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"    {t * per:7.2f} ms  {100 * t / total:5.1f} %  {key}")
        lines.append(f"  top {top} of our functions by total time (ms per round):")
        for key, t in sorted(ours_total.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"    {t * per:7.2f} ms  {100 * t / total:5.1f} %  {key}")
        return lines


def profile(label: str, make: Callable[[Any, int], Callable[[], None]], deps: Any, repeat: int) -> Profile:
    from pyinstrument import Profiler
    from pyinstrument.session import Session

    make(deps, -1)()  # warm-up: imports, connections, statement caches
    counts = Counts()
    sessions, rounds = [], []
    for n in range(repeat):
        run = make(deps, n)
        profiler = Profiler(interval=0.0002)
        started = time.perf_counter()
        counts.counting = True
        profiler.start()
        run()
        profiler.stop()
        counts.counting = False
        rounds.append(time.perf_counter() - started)
        assert profiler.last_session is not None
        sessions.append(profiler.last_session)
    combined = sessions[0]
    for more in sessions[1:]:
        combined = Session.combine(combined, more)
    return Profile(label, rounds, combined, dict(counts.values))


def timed(label: str, make: Callable[[Any, int], Callable[[], None]], deps: Any, repeat: int) -> list[str]:
    """Without a profiler: rounds in alternating blocks (of 8, fewer for fewer rounds), with the statements that
    ``built_once`` marks as yielding plain rows run on the transaction's Connection (as
    shipped) and with every statement through the Session's ORM path (the baseline, as before
    2026-12-03), in this one process. Per round: the wall time and this thread's CPU (the
    scripted model answers from another thread), medians with the quartiles."""
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    import models.db

    shipped = models.db._Session.execute
    orm_statements = [0]

    def on_orm(_: Any) -> None:
        orm_statements[0] += 1

    make(deps, -1)()  # warm-up: imports, connections, statement caches
    counts = Counts()
    event.listen(Session, "do_orm_execute", on_orm)
    block = min(8, max(1, repeat // 2))
    kinds = {"plain rows on the Connection": shipped, "every statement through the Session": Session.execute}
    walls: dict[str, list[float]] = defaultdict(list)
    cpus: dict[str, list[float]] = defaultdict(list)
    through_orm: dict[str, int] = defaultdict(int)
    statements: dict[str, int] = defaultdict(int)
    try:
        for n in range(repeat):
            kind = list(kinds)[(n // block) % 2]
            models.db._Session.execute = kinds[kind]  # type: ignore[method-assign]
            run = make(deps, n)
            orm_statements[0], counts.values["statements"] = 0, 0
            counts.counting = True
            started, cpu = time.perf_counter(), time.thread_time()
            run()
            walls[kind].append(time.perf_counter() - started)
            cpus[kind].append(time.thread_time() - cpu)
            counts.counting = False
            through_orm[kind] += orm_statements[0]
            statements[kind] += counts.values["statements"]
    finally:
        models.db._Session.execute = shipped  # type: ignore[method-assign]
        event.remove(Session, "do_orm_execute", on_orm)

    def spread(values: list[float]) -> str:
        q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
        return f"{statistics.median(values) * 1000:.1f} ms ({q[0] * 1000:.1f}-{q[2] * 1000:.1f})"

    lines = [f"{label}, no profiler, {repeat} rounds in alternating blocks of {block}:"]
    for kind in kinds:
        k = len(walls[kind])
        if k:
            lines.append(
                f"  {kind}: wall {spread(walls[kind])}, this thread's CPU {spread(cpus[kind])}; "
                f"{statements[kind] / k:.1f} statements a round, {through_orm[kind] / k:.1f} through the ORM path"
            )
    if all(walls[kind] for kind in kinds):
        plain, orm = (statistics.median(cpus[kind]) for kind in kinds)
        wall_plain, wall_orm = (statistics.median(walls[kind]) for kind in kinds)
        lines.append(f"  ratio plain/ORM path: CPU {plain / orm:.2f}, wall {wall_plain / wall_orm:.2f}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/profile.py", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="profiled rounds of each path (default 20)")
    parser.add_argument("--children", type=int, default=2, help="children per round (default 2)")
    parser.add_argument("--top", type=int, default=12, help="functions listed per table (default 12)")
    parser.add_argument("--html", type=Path, default=None, help="also write pyinstrument's HTML reports here")
    parser.add_argument(
        "--timed",
        action="store_true",
        help="no profiler: wall and CPU per round, the Session's ORM path for every statement as the baseline",
    )
    args = parser.parse_args(argv)
    if min(args.repeat, args.children, args.top) < 1:
        parser.error("--repeat, --children and --top must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.timed:
        try:
            import pyinstrument  # noqa: F401 - only whether it imports
        except ImportError:
            print(f"profile: {INSTALL_HINT}; nothing measured.")
            return 0
    import logging
    import os

    from bench._common import REDIS_BASE, REDIS_DBS, bench_database
    from bench._figures import system_load
    from doubles.scripted_model import ScriptedModelServer

    logging.disable(logging.INFO)  # the loop's info lines would go to stderr unformatted
    os.environ["REDIS_URL"] = f"{REDIS_BASE}/{REDIS_DBS[2]}"  # session_status events, as in production
    print(
        f"profile: {args.repeat} normal delegating rounds and {args.repeat} recoveries of 1 parent -> "
        f"{args.children} children, in-process ({'no profiler' if args.timed else 'pyinstrument'}); {system_load()}",
        flush=True,
    )
    with bench_database("bench_profile"), ScriptedModelServer(script(args.children)) as model:
        from tests.helpers import RecordingScheduler, loop_deps

        deps = loop_deps(model.base_url, RecordingScheduler(), lease_seconds=30)
        if args.timed:
            for label, make in (("normal delegating round", normal_round), ("recovery", recovery_round)):
                print("\n".join(timed(label, make, deps, args.repeat)), flush=True)
            print(f"timed in one process; {system_load()}")
            return 0
        results = [
            profile("normal delegating round", normal_round, deps, args.repeat),
            profile("recovery (scan -> recover_child -> deliver -> parent run)", recovery_round, deps, args.repeat),
        ]
    for result in results:
        print("\n".join(result.report(args.top)))
        if args.html is not None:
            args.html.mkdir(parents=True, exist_ok=True)
            from pyinstrument.renderers import HTMLRenderer

            path = args.html / (result.label.split(" ")[0] + ".html")
            path.write_text(HTMLRenderer().render(result.session))
            print(f"  full report: {path}")
    print(f"profiled in one process; {system_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
