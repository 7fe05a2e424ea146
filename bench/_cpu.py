"""Where a timed window's CPU went, by process class (Linux ``/proc``): the workers' pool
processes, the workers' main processes (Celery's consumer), the PostgreSQL backends serving
the bench's database, this bench process (the scripted model's threads and the bench's own
polling) and the rest of the machine (Redis, the kernel, anything else).

A window of W seconds on two cores has 2 x W core-seconds: the classes say who spent them,
and what is left was idle (every process of the work waiting: on PostgreSQL's commits, on a
round trip, on the model's answer).

Used by ``bench/recovery.py --cpu`` and ``bench/peer_dbos.py --cpu`` (``add_cpu_option``)::

    meter = start_meter([w.proc.pid for w in fresh], url)
    ...  # the timed window
    print(meter.stop().report(per=expected, unit="delivery"))
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC = "/proc"


def available() -> bool:
    """True where ``/proc`` gives per-process CPU times (Linux)."""
    return os.path.exists(f"{PROC}/self/stat") and os.path.exists(f"{PROC}/stat")


class _CpuOption(argparse.Action):
    """``--cpu``: a flag that refuses where ``/proc`` is missing."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, *_: object) -> None:
        if not available():
            parser.error("--cpu reads per-process CPU times from /proc (Linux only)")
        setattr(namespace, self.dest, True)


def add_cpu_option(parser: argparse.ArgumentParser, help: str) -> None:
    """The benches' ``--cpu`` flag (``args.cpu``, False by default)."""
    parser.add_argument("--cpu", action=_CpuOption, nargs=0, default=False, help=help)


def _process(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of ``pid``; None when it is gone."""
    try:
        with open(f"{PROC}/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _machine_busy() -> float:
    """CPU seconds the whole machine spent busy since boot (every state but idle and iowait)."""
    with open(f"{PROC}/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / TICK


def process_cpu(pid: int) -> float:
    """User + system CPU seconds ``pid`` has spent so far (0 when it is gone)."""
    info = _process(pid)
    return info[1] if info is not None else 0.0


def _children(pids: Iterable[int]) -> set[int]:
    """The direct children of ``pids`` now alive (a prefork pool's processes)."""
    parents = set(pids)
    found: set[int] = set()
    for entry in os.listdir(PROC):
        if entry.isdigit():
            info = _process(int(entry))
            if info is not None and info[0] in parents:
                found.add(int(entry))
    return found


def _backends(database: str) -> set[int]:
    """The PostgreSQL backends connected to ``database`` (pg_stat_activity, the bench's URL)."""
    from sqlalchemy import text

    from models import transaction

    with transaction() as s:
        return {
            int(pid)
            for (pid,) in s.execute(
                text("SELECT pid FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": database}
            )
        }


@dataclass
class CpuSplit:
    wall_s: float
    cores: int
    seconds: dict[str, float] = field(default_factory=dict)

    def lines(self, per: int, unit: str) -> list[str]:
        """One line per class: CPU seconds, share of the window's core-seconds, ms per ``unit``."""
        capacity = self.wall_s * self.cores
        out = [
            f"CPU during the timed window ({self.wall_s:.2f} s x {self.cores} cores = {capacity:.2f} core-s), "
            f"by process class:"
        ]
        for name, value in self.seconds.items():
            share = 100 * value / capacity if capacity else 0.0
            out.append(f"  {value:6.2f} s  {share:5.1f} %  {1000 * value / max(per, 1):6.1f} ms per {unit}  {name}")
        return out

    def report(self, per: int, unit: str) -> str:
        """:meth:`lines` as one block, indented under a trial's line."""
        return "\n".join("    " + line for line in self.lines(per, unit))


class CpuMeter:
    """CPU seconds spent between :meth:`start` and :meth:`stop`, by process class. A process
    that starts inside the window counts from zero; one that exits inside it is lost (the
    workers and the connection pools' backends live through a window)."""

    def __init__(self, worker_pids: Iterable[int], database: str) -> None:
        self.workers = list(worker_pids)
        self.database = database
        self._start: dict[int, float] = {}
        self._self_start = 0.0
        self._machine_start = 0.0
        self._wall_start = 0.0

    def add_worker(self, pid: int) -> None:
        """A worker spawned inside the window (a restart): its CPU, and its pool's, count from
        zero."""
        self.workers.append(pid)

    def _classes(self) -> dict[str, set[int]]:
        return {
            "worker pool processes (the tasks' work)": _children(self.workers),
            "worker main processes (Celery's consumer)": set(self.workers),
            "PostgreSQL backends of the bench database": _backends(self.database),
        }

    def _sample(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for pids in self._classes().values():
            for pid in pids:
                info = _process(pid)
                if info is not None:
                    out[pid] = info[1]
        return out

    def start(self) -> None:
        self._start = self._sample()
        times = os.times()
        self._self_start = times.user + times.system
        self._machine_start = _machine_busy()
        self._wall_start = time.monotonic()

    def stop(self) -> CpuSplit:
        wall = time.monotonic() - self._wall_start
        machine = _machine_busy() - self._machine_start
        times = os.times()
        split = CpuSplit(wall, os.cpu_count() or 1)
        counted = 0.0
        for name, pids in self._classes().items():
            spent = 0.0
            for pid in pids:
                info = _process(pid)
                if info is not None:
                    spent += max(0.0, info[1] - self._start.get(pid, 0.0))
            split.seconds[name] = spent
            counted += spent
        own = times.user + times.system - self._self_start
        split.seconds["this bench process (the scripted model's threads, polling)"] = own
        counted += own
        split.seconds["rest of the machine (Redis, kernel, other processes)"] = max(0.0, machine - counted)
        return split


def start_meter(worker_pids: Iterable[int], url: str) -> CpuMeter:
    """A started :class:`CpuMeter` over ``worker_pids`` and the backends of ``url``'s database."""
    meter = CpuMeter(worker_pids, database=url.rsplit("/", 1)[-1].split("?")[0])
    meter.start()
    return meter


@dataclass
class Settled:
    """What :func:`settle` did before a timed window."""

    seconds: float
    #: The share of every core busy over the last quiet window (None: no ``/proc``).
    busy_share: float | None
    checkpointed: bool
    off: bool = False

    def note(self) -> str:
        if self.off:
            return "settled: off (BENCH_SETTLE_SECONDS < 0)"
        busy = "" if self.busy_share is None else f", machine {100 * self.busy_share:.0f} % busy"
        checkpoint = "CHECKPOINT, " if self.checkpointed else ""
        return f"settled: {checkpoint}{self.seconds:.1f} s{busy}"


#: Quiet enough to start a timed window: under this share of all cores busy over QUIET_WINDOW.
QUIET_SHARE = 0.15
QUIET_WINDOW_SECONDS = 0.5
#: The longest wait for quiet (``BENCH_SETTLE_SECONDS``; 0: one window measured, no wait; a
#: negative value: no settling at all, neither CHECKPOINT nor window, for an A/B of this).
SETTLE_AT_MOST_SECONDS = 10.0


def settle(admin_url: str | None = None, *, at_most: float | None = None, cap: float | None = None) -> Settled:
    """Before a timed window, on either side of a comparison: PostgreSQL writes out what the
    work before left dirty (a CHECKPOINT, so that no side's window pays for the other's writes),
    then the machine's CPU is let go quiet (under QUIET_SHARE of every core busy over
    QUIET_WINDOW_SECONDS), waiting at most ``at_most`` seconds. A DBOS trial of 50 parents left
    PostgreSQL and the machine busy into the next trial of ours: 1.44 s of CPU outside the bench's
    processes in a 5 s window, against 0.1-0.35 s after a quiet start. ``cap``: a bound the
    window's own set-up imposes (a restart's leases must not lapse meanwhile)."""
    if at_most is None:
        at_most = float(os.environ.get("BENCH_SETTLE_SECONDS", SETTLE_AT_MOST_SECONDS))
    if at_most < 0:
        return Settled(0.0, None, False, off=True)
    if cap is not None:
        at_most = min(at_most, cap)
    started = time.monotonic()
    checkpointed = _checkpoint(admin_url)
    share: float | None = None
    if available():
        cores = os.cpu_count() or 1
        while True:
            before, t = _machine_busy(), time.monotonic()
            time.sleep(QUIET_WINDOW_SECONDS)
            share = (_machine_busy() - before) / ((time.monotonic() - t) * cores)
            if share < QUIET_SHARE or time.monotonic() - started >= at_most:
                break
    return Settled(time.monotonic() - started, share, checkpointed)


def _checkpoint(admin_url: str | None) -> bool:
    """CHECKPOINT on the bench's PostgreSQL (a superuser or ``pg_checkpoint`` member); False when
    it may not."""
    from sqlalchemy import text
    from sqlalchemy.exc import SQLAlchemyError

    from bench._common import admin_engine

    engine = admin_engine(admin_url)
    try:
        with engine.connect() as conn:
            conn.execute(text("CHECKPOINT"))
        return True
    except SQLAlchemyError:
        return False
    finally:
        engine.dispose()
