"""The hot statements built and compiled in each pool process before its first task needs them.

A pool process builds each ``built_once`` statement the first time it needs it, and SQLAlchemy
compiles each statement the first time the process runs it (the compiled cache is the
engine's, per process). A fresh pool process's first recovery task paid 50-80 ms for that, and
its first PostgreSQL connection (docs/benchmarks.md, "A crash recovery's first tasks").

``warm_shapes.json`` lists the statements the agent and recovery tasks ran in real workers:
for each, its ``built_once`` builder, the builder's arguments and the parameter names its call
passed. :func:`compile_hot_statements` builds each one and compiles it into the engine's cache
without sending it: on a connection marked ``models.db.WARM_UP_ONLY``, each execution ends
before the driver is called. :func:`warm_up_in_background` runs it in a daemon thread of each
pool process as it starts (``tasks.signals``), in the process's idle time: it never holds up
a boot, and it pauses while the process runs a task, so work that is already queued (a
restart's) never waits for it.

The list is recorded, not written by hand: ``tests/integration/test_warmup.py`` runs a crash and
its recovery, and a delivery-only recovery, with ``tests/shape_recorder.py`` in the workers. It
fails when a task compiled a built statement the warm-up should have compiled, or ran one the
list does not have; ``WRITE_WARM_SHAPES=1`` rewrites the list from what it recorded. An entry
whose builder is gone or whose arguments no longer fit is skipped and counted (its statement
then compiles at first use, as before): a stale list costs speed, never a result.
"""

from __future__ import annotations

import enum
import importlib
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, exc

from logfmt import log_event
from models.db import BUILT_BY, WARM_UP_ONLY, unbegun_session
from models.worker import identity

log = logging.getLogger(__name__)

SHAPES_FILE = Path(__file__).with_name("warm_shapes.json")

# --- a shape: a built statement, as a call used it -----------------------------------------------


def shape_of(statement: Any, params: Mapping[str, Any], many: bool) -> dict[str, Any] | None:
    """The shape of one execution of a ``built_once`` statement (None for any other statement):
    its builder, the builder's arguments (this worker's identity written as ``{"me": true}``),
    the statement's index in a builder that returns several, the parameter names passed (and
    which of them carried a list: an expanding IN) and whether it ran as an executemany."""
    origin = getattr(statement, BUILT_BY, None)
    if origin is None:
        return None
    module, name, args, index = origin
    me = identity()
    return {
        "builder": f"{module}:{name}",
        "args": [_encode(arg, me) for arg in args],
        "index": index,
        "keys": sorted(params),
        "lists": sorted(k for k, v in params.items() if isinstance(v, list | tuple)),
        "many": many,
    }


def shape_key(shape: dict[str, Any]) -> str:
    return json.dumps(shape, sort_keys=True)


def _encode(value: Any, me: tuple[str, int] | None) -> Any:
    if me is not None and isinstance(value, tuple) and value == me:
        return {"me": True}
    if isinstance(value, enum.Enum):
        return {"enum": f"{type(value).__module__}:{type(value).__qualname__}", "name": value.name}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, me) for v in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a built_once argument of type {type(value).__name__} has no JSON form")


def _decode(value: Any, me: tuple[str, int] | None) -> Any:
    if isinstance(value, dict):
        if "me" in value:
            if me is None:
                raise LookupError("this process has no boot identity")
            return me
        if "enum" in value:
            return getattr(_resolve(value["enum"]), value["name"])
        if "tuple" in value:
            return tuple(_decode(v, me) for v in value["tuple"])
        raise ValueError(f"unknown argument form {sorted(value)}")
    return value


def _resolve(ref: str) -> Any:
    module, _, name = ref.partition(":")
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def load_shapes(path: Path = SHAPES_FILE) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    data = json.loads(path.read_text(encoding="utf-8"))
    return list(data["shapes"])


def write_shapes(shapes: Iterable[dict[str, Any]], path: Path = SHAPES_FILE) -> None:
    unique = {shape_key(s): s for s in shapes}
    ordered = [unique[k] for k in sorted(unique)]
    body = {
        "about": "Statements each pool process compiles in its idle time (models/warmup.py). "
        "Recorded by tests/integration/test_warmup.py: WRITE_WARM_SHAPES=1 rewrites it.",
        "shapes": ordered,
    }
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n", encoding="utf-8")


# --- the warm-up -------------------------------------------------------------------------------


def compile_hot_statements(
    engine: Engine, shapes: list[dict[str, Any]] | None = None, spells: QuietSpells | None = None
) -> dict[str, Any]:
    """Build every shape's statement and compile it into ``engine``'s cache, sending nothing to
    the database (``models.db.WARM_UP_ONLY``); with ``spells``, each one only in a quiet spell
    of the process.
    Returns ``{"compiled": n, "skipped": n, "ms": elapsed}``: a shape that no longer fits the
    code, or does not compile for this database, is skipped (its statement compiles at first
    use, as without a warm-up)."""
    shapes = load_shapes() if shapes is None else shapes
    started = time.perf_counter()
    me = identity()
    compiled = skipped = 0
    for shape in shapes:
        if spells is not None:
            spells.wait()
        # Through a Session as the tasks' own: a statement with mapped entities takes the ORM's
        # path there, and its compiled form is the ORM's. The mark rides on the Session's
        # connection: an option on the statement or a keyword of Session.execute would change
        # the path (and so the cache entry) it takes.
        try:
            statement = _built(shape, me)
            params: dict[str, Any] = {key: [] if key in shape["lists"] else None for key in shape["keys"]}
        except Exception:  # the shape no longer fits the code: its builder moved or changed
            skipped += 1
            continue
        with unbegun_session(engine) as s:
            s.connection(execution_options={WARM_UP_ONLY: True})  # no database: the warm-up ends
            try:
                s.execute(statement, [params, dict(params)] if shape["many"] else (params or None))
                compiled += 1
            except exc.CompileError:  # not for this database, or the call's keys changed
                skipped += 1
            except Exception:  # compiled and cached; reading a result no row is behind may raise
                compiled += 1  # anything (the ORM's loading raises NotImplementedError)
            finally:
                s.rollback()  # nothing was sent: the driver began no transaction
    return {"compiled": compiled, "skipped": skipped, "ms": round((time.perf_counter() - started) * 1000, 1)}


#: Set once this process's background warm-up went through the whole list (tests read it).
warmed = threading.Event()
#: How long the process must have run no task before the warm-up goes on: tasks that follow
#: each other a few milliseconds apart (a queue being drained) never share the CPU with it.
QUIET_SECONDS = 0.05


class QuietSpells:
    """Whether this process runs a task (``tasks.signals`` reports each one's start and end),
    and since when it has run none: :meth:`wait` returns in a quiet spell, i.e. before the
    process's first task, or :data:`QUIET_SECONDS` after its last one ended. Tasks are
    counted: on a threads pool many run at once, and the process is quiet only when none does."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self._since: float | None = None  # None: no task yet
        self._running = 0
        self._lock = threading.Lock()

    def task_began(self) -> None:
        with self._lock:
            self._running += 1
            self._idle.clear()

    def task_ended(self) -> None:
        with self._lock:
            self._running = max(0, self._running - 1)
            if self._running == 0:
                self._since = time.monotonic()
                self._idle.set()

    def wait(self) -> None:
        while True:
            self._idle.wait()
            since = self._since
            if since is None:
                return
            quiet = time.monotonic() - since
            if quiet >= QUIET_SECONDS:
                return
            time.sleep(QUIET_SECONDS - quiet)


#: This process's quiet spells (the warm-up waits for one before each statement).
quiet = QuietSpells()


def warm_up_in_background(engine: Engine) -> threading.Thread:
    """:func:`compile_hot_statements` in a daemon thread of this (pool) process, in its idle
    time: from its start until its first task, then only after :data:`QUIET_SECONDS` without
    one. At most one statement's compilation shares the CPU with a task that just began, so
    work that is already queued, a restart's, hardly waits for it. Logs ``event=worker_warm_up``
    with its counts and its duration (idle waits included), or ``worker_warm_up_failed``."""

    def run() -> None:
        try:
            done = compile_hot_statements(engine, spells=quiet)
        except Exception as error:  # only a speed-up: the statements compile at first use
            log_event(log, "worker_warm_up_failed", logging.WARNING, error=type(error).__name__)
            return
        warmed.set()
        log_event(log, "worker_warm_up", **done)

    thread = threading.Thread(target=run, name="statement-warm-up", daemon=True)
    thread.start()
    return thread


def _built(shape: dict[str, Any], me: tuple[str, int] | None) -> Any:
    builder = _resolve(shape["builder"])
    built = builder(*(_decode(arg, me) for arg in shape["args"]))
    return built if shape["index"] is None else built[shape["index"]]
