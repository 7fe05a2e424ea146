"""The Celery app (`celery -A tasks worker`). Tasks are thin adapters over the domain.

A worker's boot is mostly imports, and the cyclic garbage collector, run every few hundred
allocations while they run, walks every object they made so far, again and again. So the
collector is paused while this package imports the app. In any process
it is back on when the import returns, except in ``celery ... worker``, where the pause lasts
through the task modules until ``worker_init``, just before the pool forks: there the boot's
objects are frozen (``gc.freeze``, as Python's documentation advises for a process that forks
without exec) and the collector is back on. No later collection, in the worker or in a pool
process, walks them again, and a pool process's collections leave their pages shared. Just
before, work every pool process would repeat as it starts is done once (``_parse_prctl_once``,
``_configure_mappers_once``).
"""

from __future__ import annotations

import gc

from celery import Celery
from celery.signals import worker_init

#: Whether the collector was on when this package's import began (set back to that at resume).
_COLLECTOR_WAS_ENABLED = gc.isenabled()
_paused = True
gc.disable()


def _booting_a_worker() -> bool:
    """True inside ``celery -A tasks worker``: Celery's command line imports the app in its
    group's callback, where click already knows the subcommand it will run."""
    import click

    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.invoked_subcommand == "worker"


def _resume_collector(*, freeze: bool) -> None:
    """End the boot's pause of the collector (later calls do nothing). ``freeze``: the objects
    made so far move to the permanent generation first (no collection walks them again; the few
    cycles they already left unreachable stay allocated: a bounded, one-time cost)."""
    global _paused
    if not _paused:
        return
    _paused = False
    if freeze:
        gc.freeze()
    if _COLLECTOR_WAS_ENABLED:
        gc.enable()


@worker_init.connect
def _resume_collector_before_fork(**_: object) -> None:
    _parse_prctl_once()
    _configure_mappers_once()
    _resume_collector(freeze=True)


def _configure_mappers_once() -> None:
    """SQLAlchemy configures the ORM's mappers at their first use, about 50 ms of CPU: done
    here, before the pool forks, once for every pool process instead of in each one's first
    task."""
    from sqlalchemy.orm import configure_mappers

    try:
        configure_mappers()
    except Exception:  # only a speed-up: the first use raises the same error where it matters
        pass


def _parse_prctl_once() -> None:
    """Every pool process sets its parent-death signal as it starts
    (``billiard.util.set_pdeathsig``), through cffi when cffi is imported (billiard imports it
    when it is installed): its first C declaration in a process builds cffi's C parser
    (pycparser's tables), 0.10-0.16 s of CPU in EACH pool process before its first task (2
    cores, load 2). Declared once here, before the pool forks, the parser is built once and the
    pool processes inherit it: 2 ms each. (Frozen with the boot's objects right after.)"""
    import sys

    if "cffi" not in sys.modules:
        return
    try:
        import cffi

        cffi.FFI().cdef("int prctl (int __option, ...);")
    except Exception:  # only a speed-up: billiard declares it again anyway
        pass


def _load_tools() -> None:
    """TOOL_MODULES and entry points imported, every agent's tools checked, before the worker
    (or beat, or the CLI) takes anything: a configuration error stops the process here."""
    import sys

    from harness.agents import load_at_start
    from harness.errors import AgentConfigError

    try:
        load_at_start()
    except AgentConfigError as exc:
        print(f"agent-recovery: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


try:
    import celeryconfig

    app = Celery("agent_recovery")
    app.conf.update(celeryconfig.build())

    import tasks.queues  # noqa: F401  (every publisher stamps sent_at: `status` shows queue waits)

    _load_tools()
except BaseException:
    _resume_collector(freeze=False)
    raise
if not _booting_a_worker():
    _resume_collector(freeze=False)

__all__ = ["app"]
