"""``python -m bench._boot_marks -A tasks worker ...``: the ``celery`` command (the same
``celery.__main__.main`` its console script calls), with a line at each step of the boot, for
``bench/boot.py``.

Each line is ``boot_mark step=NAME t=SECONDS cpu=SECONDS pid=PID`` on stderr: ``t`` is
``time.monotonic()`` (one clock for every process of the machine on Linux, so the bench
subtracts its own spawn time), ``cpu`` this process's CPU so far. The steps, in order:

- ``interpreter``: Python is up and this module runs (site, the standard library's start);
- ``cli``: Celery's command line imported (``celery.bin.celery``, every subcommand with it);
- ``app``: the app (``-A tasks``) imported and configured; Celery is about to import the task
  modules (``import_modules``);
- ``worker_init``: the task modules imported, the worker set up; ``worker_init``'s receivers
  (ours: the boot generation, the work done once before the fork) run after this line;
- ``after_setup``: they ran; the pool, the consumer and the embedded beat start next;
- ``pool_process``: a pool process forked and initialized (one line per process);
- ``ready``: the banner printed, the pool and the beat started, the consumer ready
  (``worker_ready``).

With ``BOOT_MARKS_EXIT=1`` the process exits at ``ready`` (``os._exit``; its pool processes
follow it by their parent-death signal): ``bench/boot.py --imports`` runs it once under
``python -X importtime``.
"""

from __future__ import annotations

import os
import sys
import time


def mark(step: str) -> None:
    print(
        f"boot_mark step={step} t={time.monotonic():.6f} cpu={time.process_time():.6f} pid={os.getpid()}",
        file=sys.__stderr__,
        flush=True,
    )


def main() -> None:
    mark("interpreter")
    import celery.bin.celery  # noqa: F401  (what the console script imports first)
    from celery import signals

    mark("cli")
    # weak=False: these receivers are module-level lambdas' only references.
    signals.import_modules.connect(lambda **_: mark("app"), weak=False)
    signals.worker_init.connect(lambda **_: mark("worker_init"), weak=False)
    signals.celeryd_after_setup.connect(lambda **_: mark("after_setup"), weak=False)
    signals.worker_process_init.connect(lambda **_: mark("pool_process"), weak=False)

    def ready(**_: object) -> None:
        mark("ready")
        if os.environ.get("BOOT_MARKS_EXIT") == "1":
            sys.__stderr__.flush()
            os._exit(0)

    signals.worker_ready.connect(ready, weak=False)
    from celery.__main__ import main as celery_main

    sys.argv = ["celery", *sys.argv[1:]]
    celery_main()


if __name__ == "__main__":
    main()
