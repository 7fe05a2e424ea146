"""The stand-in parsing agent: its behaviours, its options, and what it answers.

``answer_for`` is its reasoning, a correct RecoveryPatchSet for a RecoveryRequestSet;
``answer_text`` is the final message a behaviour turns that into (see doubles/superagent.py for
what each behaviour means).

Deterministic rules, using only what the request carries (as the real agent must):

* ``date`` task: the earliest candidate on or after the sent date (evidence ``H:date``) and,
  when the task depends on other date tasks, strictly after their recovered values
  (a departure follows its arrival). No candidate fits -> unresolved.
* ``enum`` task: the candidate sharing the most words with the evidence line (ignoring
  generic words such as "room"); a tie or no shared word -> unresolved ``ambiguous``.
* a task whose dependency stayed unresolved is unresolved too; other types are unresolved.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from datetime import date, timedelta
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import Any

from fieldrecovery.request_builder import parse_message
from fieldrecovery.schemas import (
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


class Behaviour(StrEnum):
    NORMAL = "normal"
    SLOW = "slow"
    CUT_REPLAYABLE = "cut_replayable"
    CUT_UNRECOVERABLE = "cut_unrecoverable"
    FENCED = "fenced"
    PROSE = "prose"
    UNKNOWN_FIELD = "unknown_field"
    NON_JSON = "non_json"
    OVERSIZE = "oversize"
    BAD_PATCH = "bad_patch"
    REJECT_ALL = "reject_all"
    DEEP_JSON = "deep_json"
    RUN_FAILED = "run_failed"
    STATUS_FAILED = "status_failed"
    TRACE_REFUSED = "trace_refused"
    UNAUTHORIZED = "unauthorized"
    SERVER_ERROR = "server_error"
    CREATED_201 = "created_201"
    SLOW_HEADERS = "slow_headers"
    GZIP = "gzip"
    GZIP_ALWAYS = "gzip_always"
    PLATFORM_CSRF_COOKIE = "platform_csrf_cookie"
    HEARTBEAT = "heartbeat"
    UNTERMINATED_AT_EOF = "unterminated_at_eof"
    REPLAY_IN_PROGRESS = "replay_in_progress"
    LONE_SURROGATE = "lone_surrogate"
    NUL_MODEL = "nul_model"
    NUL_PROFILE = "nul_profile"
    HUGE_TOKENS = "huge_tokens"
    GZIP_BOMB = "gzip_bomb"
    BARE_END = "bare_end"


@dataclass(frozen=True)
class StubConfig:
    behaviour: Behaviour = Behaviour.NORMAL
    #: Chunked transfer encoding for SSE; False delimits the body by closing the connection.
    chunked: bool = True
    #: cut_*: complete events written before the cut.
    cut_after: int = 3
    #: cut_*: also write the first half of the next event before cutting.
    cut_mid_event: bool = False
    #: Pause between events (all behaviours).
    event_delay: float = 0.0
    #: slow: silence before message.final (a cancel or stop ends it).
    stall_seconds: float = 30.0
    #: slow: send a ``: keepalive`` comment every 0.2 s while stalling (defeats read timeouts).
    drip: bool = False
    #: oversize: characters of padding added to the answer.
    oversize_chars: int = 250_000
    #: deep_json: nesting depth of the answer.
    deep_json_depth: int = 50_000
    #: slow_headers: the endpoint whose response head drips (``session`` or ``stream``).
    slow_headers_on: str = "stream"
    #: slow_headers: pause between two bytes of the status line and headers.
    header_drip_seconds: float = 0.5
    #: replay_in_progress: the run produces one more event every this many seconds.
    replay_step_seconds: float = 0.25
    #: gzip_bomb: decoded size of the gzip body of the bombed response (zeros, ~1000:1).
    bomb_bytes: int = 50_000_000
    #: gzip_bomb: the endpoint whose response is the bomb: ``session`` (a JSON or error body) or
    #: ``stream`` (the message stream: ``run.started``, then one data line that never ends).
    bomb_on: str = "session"
    #: gzip_bomb: status of that response (401: an error body; 200: a JSON body padded with spaces).
    bomb_status: int = 401
    #: run_failed: the code of the ``error`` event (a hostile peer may put the key in it).
    error_code: str = "run_failed"
    #: The ``status`` every run status answers with instead of the run's own (empty: the run's).
    reported_status: str = ""
    #: Informational replies (e.g. 103 Early Hints, 102 Processing) written before the real
    #: response of the ``informational_on`` endpoint (``session`` or ``stream``).
    informational: tuple[int, ...] = ()
    informational_on: str = "stream"
    #: Appended to the value of every ``id:`` line (an id with a NUL or an escape).
    event_id_suffix: str = ""
    #: The session id and run id handed out instead of generated ones (empty: generated).
    session_id: str = ""
    run_id: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StubConfig:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "behaviour" in values:
            values["behaviour"] = Behaviour(values["behaviour"])
        if "informational" in values:
            values["informational"] = tuple(int(v) for v in values["informational"])
        return cls(**values)


def answer_text(request_content: str, config: StubConfig) -> str:
    patch_set = answer_for(parse_message(request_content)).model_dump(mode="json")
    behaviour = config.behaviour
    if behaviour == Behaviour.BAD_PATCH and patch_set["patches"]:
        first = patch_set["patches"][0]
        first["value"] = first["value"] + "x"  # no longer the value of its candidate ref
    if behaviour == Behaviour.REJECT_ALL:
        for patch in patch_set["patches"]:
            patch["value"] = patch["value"] + "x"
    if behaviour == Behaviour.UNKNOWN_FIELD:
        patch_set["reasoning"] = "chosen by evidence"
    if behaviour == Behaviour.LONE_SURROGATE and patch_set["patches"]:
        # Valid JSON (the event carries it as an escape) that no UTF-8 encoder accepts.
        patch_set["patches"][0]["value"] = patch_set["patches"][0]["value"] + "\ud800"
    text = json.dumps(patch_set, ensure_ascii=False)
    if behaviour == Behaviour.FENCED:
        return f"```json\n{text}\n```"
    if behaviour == Behaviour.PROSE:
        return f"Here is the RecoveryPatchSet you asked for:\n{text}\nLet me know if you need more."
    if behaviour == Behaviour.NON_JSON:
        return "I could not settle these fields."
    if behaviour == Behaviour.OVERSIZE:
        return text + " " * config.oversize_chars
    if behaviour == Behaviour.DEEP_JSON:
        return '{"x":' + "[" * config.deep_json_depth + "]" * config.deep_json_depth + "}"
    return text
