"""What a worker's boot imports and how it treats the garbage collector: each in a fresh
interpreter, since a test process has long imported everything.

A worker imports the app and its task modules (``import tasks`` then the loader's
``import_default_modules``) before it takes anything: a package that only an unused feature
needs (the MCP SDK, edited approval arguments, field recovery, the console) must not be among
them. Re-adding an eager import makes the first test fail and name the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))

#: Packages a worker needs only when a feature runs: an agent lists an MCP server (``mcp``,
#: ``anyio``), an approver edits arguments (``jsonschema``), a field task runs
#: (``fieldrecovery``), or an operator opens the console (``console``, ``starlette``, ``jinja2``).
NOT_AT_BOOT = ("mcp", "anyio", "jsonschema", "fieldrecovery", "console", "starlette", "jinja2")


def _python(code: str, *, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_worker_boot_imports_no_package_that_only_an_unused_feature_needs() -> None:
    loaded = _python(
        "import json, sys\n"
        "import tasks\n"
        "tasks.app.loader.import_default_modules()\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({NOT_AT_BOOT!r}))))\n"
    )
    assert json.loads(loaded) == [], f"imported at a worker's boot: {loaded}"


def test_the_checker_sees_a_package_imported_at_boot() -> None:
    # The same check with one of them imported by a task module (here, by hand) does fail.
    loaded = _python(
        "import json, sys\n"
        "import tasks, jsonschema\n"
        "tasks.app.loader.import_default_modules()\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({NOT_AT_BOOT!r}))))\n"
    )
    assert json.loads(loaded) == ["jsonschema"]


def test_the_task_modules_still_register_every_task_name() -> None:
    names = _python(
        "import json, tasks\n"
        "tasks.app.loader.import_default_modules()\n"
        "print(json.dumps(sorted(n for n in tasks.app.tasks if not n.startswith('celery.'))))\n"
    )
    assert set(json.loads(names)) >= {
        "agent.run",
        "agent.run_child",
        "agent.deliver_round",
        "agent.approve",
        "agent.deny",
        "recovery.scan",
        "recovery.recover_child",
        "recovery.recover_children",
        "recovery.fan_out",
        "recovery.redeliver",
        "recovery.redeliver_parent",
        "field.recover_eml",
        "field.purge_expired",
    }


def test_importing_the_app_outside_a_worker_leaves_the_collector_on_and_nothing_frozen() -> None:
    state = _python("import gc, tasks\nprint(gc.isenabled(), gc.get_freeze_count())")
    assert state == "True 0"


def test_importing_the_app_keeps_a_collector_that_was_off_off() -> None:
    state = _python("import gc\ngc.disable()\nimport tasks\nprint(gc.isenabled())")
    assert state == "False"


def _collector_after_celery(*argv: str) -> str:
    """Run Celery's command line with ``argv`` (a ``--help`` that stops right after the app is
    imported) and print, at exit, whether the collector is on."""
    return _python(
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print(gc.isenabled()))\n"
        f"sys.argv = [{CELERY!r}, '-A', 'tasks', *{list(argv)!r}]\n"
        "from celery.__main__ import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
    )


def test_celery_worker_keeps_the_collector_paused_after_importing_the_app() -> None:
    # `worker --help` imports the app as `worker` does, then stops before worker_init.
    assert _collector_after_celery("worker", "--help") == "False"
    assert _collector_after_celery("call", "--help") == "True"


def test_worker_init_freezes_the_boot_and_turns_the_collector_back_on() -> None:
    state = _python(
        "import gc, click\n"
        "ctx = click.Context(click.Group('celery'))\n"
        "ctx.invoked_subcommand = 'worker'\n"
        "with ctx:\n"
        "    import tasks\n"
        "paused = not gc.isenabled()\n"
        "from celery.signals import worker_init\n"
        "worker_init.send(sender=None)\n"
        "print(paused, gc.isenabled(), gc.get_freeze_count() > 1000)\n"
    )
    assert state == "True True True"


def test_worker_init_builds_the_c_parser_every_pool_process_would_build_as_it_starts() -> None:
    # billiard sets each pool process's parent-death signal through cffi when cffi is imported;
    # the C parser built at worker_init (before the fork) is the one they inherit.
    pytest.importorskip("cffi")
    state = _python(
        "import sys, billiard.util\n"
        "import tasks\n"
        "import cffi.cparser as cparser\n"
        "before = cparser._parser_cache is not None\n"
        "from celery.signals import worker_init\n"
        "worker_init.send(sender=None)\n"
        "print('cffi' in sys.modules, before, cparser._parser_cache is not None)\n"
    )
    assert state == "True False True"
