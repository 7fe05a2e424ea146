"""The stand-in parsing agent's reasoning: a correct RecoveryPatchSet for a RecoveryRequestSet.

Deterministic rules, using only what the request carries (as the real agent must):

* ``date`` task: the earliest candidate on or after the sent date (evidence ``H:date``) and,
  when the task depends on other date tasks, strictly after their recovered values
  (a departure follows its arrival). No candidate fits -> unresolved.
* ``enum`` task: the candidate sharing the most words with the evidence line (ignoring
  generic words such as "room"); a tie or no shared word -> unresolved ``ambiguous``.
* a task whose dependency stayed unresolved is unresolved too; other types are unresolved.
"""

from __future__ import annotations

import re
from datetime import date, timedelta
from email.utils import parsedate_to_datetime

from recovery.field.schemas import (
    SCHEMA_VERSION,
    RecoveryPatch,
    RecoveryPatchSet,
    RecoveryRequestSet,
    RecoveryTask,
    UnresolvedTask,
    ValueType,
)

SENT_DATE_REF = "H:date"
_GENERIC_WORDS = {"room", "rooms", "the", "a", "with", "and", "type"}
_WORD = re.compile(r"[a-z0-9]+")


def answer_for(request: RecoveryRequestSet) -> RecoveryPatchSet:
    tasks = {t.task_id: t for t in request.tasks}
    chosen: dict[str, RecoveryPatch] = {}
    unresolved: dict[str, str] = {}
    for task in _in_dependency_order(request.tasks):
        if any(dep not in chosen for dep in task.depends_on):
            unresolved[task.task_id] = "dependency_unresolved"
            continue
        if task.value_schema.type == ValueType.DATE:
            floor = [chosen[d].value for d in task.depends_on if tasks.get(d) is not None]
            patch, reason = _date(task, floor)
        elif task.value_schema.type == ValueType.ENUM:
            patch, reason = _enum(task)
        else:
            patch, reason = None, "unsupported_value_type"
        if patch is not None:
            chosen[task.task_id] = patch
        else:
            unresolved[task.task_id] = reason
    return RecoveryPatchSet(
        schema_version=SCHEMA_VERSION,
        request_id=request.request_id,
        attempt=request.attempt,
        idempotency_key=request.idempotency_key,
        patches=[chosen[t.task_id] for t in request.tasks if t.task_id in chosen],
        unresolved=[UnresolvedTask(task_id=t, reason=r) for t, r in unresolved.items()],
    )


def _in_dependency_order(tasks: list[RecoveryTask]) -> list[RecoveryTask]:
    by_id = {t.task_id: t for t in tasks}
    done: list[RecoveryTask] = []
    seen: set[str] = set()

    def visit(task: RecoveryTask, path: set[str]) -> None:
        if task.task_id in seen or task.task_id in path:
            return
        for dep in task.depends_on:
            if dep in by_id:
                visit(by_id[dep], path | {task.task_id})
        seen.add(task.task_id)
        done.append(task)

    for task in tasks:
        visit(task, set())
    return done


def _line_refs(task: RecoveryTask) -> list[str]:
    return [e.ref for e in task.evidence if e.ref != SENT_DATE_REF]


def _patch(task: RecoveryTask, ref: str, value: str, evidence_refs: list[str]) -> RecoveryPatch:
    return RecoveryPatch(
        task_id=task.task_id,
        field=task.field,
        path=task.path,
        value=value,
        evidence_refs=evidence_refs,
        candidate_ref=ref,
        confidence=0.9,
    )


def _date(task: RecoveryTask, after: list[str]) -> tuple[RecoveryPatch | None, str]:
    floor: date | None = None
    refs = _line_refs(task)
    for e in task.evidence:
        if e.ref == SENT_DATE_REF:
            try:
                floor = parsedate_to_datetime(e.text.split(":", 1)[1].strip()).date()
                refs.append(e.ref)
            except (IndexError, TypeError, ValueError):
                pass
    for value in after:
        bound = date.fromisoformat(value) + timedelta(days=1)
        floor = bound if floor is None or bound > floor else floor
    fitting = sorted(
        (date.fromisoformat(c.value), c.ref)
        for c in task.candidates
        if floor is None or date.fromisoformat(c.value) >= floor
    )
    if not fitting:
        return None, "no_candidate_fits"
    best, ref = fitting[0]
    return _patch(task, ref, best.isoformat(), refs), ""


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower())) - _GENERIC_WORDS


def _enum(task: RecoveryTask) -> tuple[RecoveryPatch | None, str]:
    said: set[str] = set()
    for e in task.evidence:
        said |= _words(e.text.split(":", 1)[-1])
    scored = sorted(
        ((len(_words(c.value) & said), i, c) for i, c in enumerate(task.candidates)), key=lambda x: (-x[0], x[1])
    )
    if not scored or scored[0][0] == 0 or (len(scored) > 1 and scored[1][0] == scored[0][0]):
        return None, "ambiguous"
    best = scored[0][2]
    return _patch(task, best.ref, best.value, _line_refs(task)), ""
