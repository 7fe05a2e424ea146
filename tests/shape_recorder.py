"""Records, inside a worker's pool processes, the ``built_once`` statements its tasks run
(``TOOL_MODULES=tests.shape_recorder``, ``SHAPE_RECORDER_OUT=<file>``): one JSON line per
execution, with the task's name, the statement's shape (``models.warmup.shape_of``) and
whether SQLAlchemy compiled it there (a cache miss) or found it compiled. Only executions
inside a task count, and never the warm-up's own (``WARM_UP_ONLY``).

Test-only: it reads SQLAlchemy's per-execution cache report
(``ExecutionContext._get_cache_stats``, what the engine's log prints as "generated in" or
"cached since"), which is not a public API."""

from __future__ import annotations

import json
import os
from typing import Any

from celery.signals import task_postrun, task_prerun
from sqlalchemy import Engine, event

from models.db import WARM_UP_ONLY
from models.warmup import shape_of, warmed

_OUT = os.environ.get("SHAPE_RECORDER_OUT", "")
_task: dict[str, Any] = {"name": None, "warmed": False}
#: Shapes seen in before_execute, waiting for their cursor execution's cache report.
_pending: dict[int, dict[str, Any]] = {}


@task_prerun.connect
def _task_started(task: Any = None, **_: object) -> None:
    _task["name"] = getattr(task, "name", None)
    _task["warmed"] = warmed.is_set()  # the warm-up had gone through its list when this task began


@task_postrun.connect
def _task_ended(**_: object) -> None:
    _task["name"] = None


@event.listens_for(Engine, "before_execute")
def _before(conn: Any, clauseelement: Any, multiparams: Any, params: Any, execution_options: Any) -> None:
    if not _OUT or _task["name"] is None or execution_options.get(WARM_UP_ONLY):
        return
    if multiparams:
        first, many = multiparams[0], len(multiparams) > 1
    else:
        first, many = params or {}, False
    shape = shape_of(clauseelement, first, many)
    if shape is not None:
        _pending[id(conn)] = shape


@event.listens_for(Engine, "after_cursor_execute")
def _after(conn: Any, cursor: Any, statement: Any, parameters: Any, context: Any, executemany: Any) -> None:
    shape = _pending.pop(id(conn), None)
    if shape is None:
        return
    line = {
        "task": _task["name"],
        "pid": os.getpid(),
        "shape": shape,
        "generated": context._get_cache_stats().startswith("generated"),
        "warmed": _task["warmed"],
    }
    with open(_OUT, "a", encoding="utf-8") as out:
        out.write(json.dumps(line, sort_keys=True) + "\n")
