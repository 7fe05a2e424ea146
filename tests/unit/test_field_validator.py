"""RecoveryPatchValidator, dependency resolver, projector and assembly (docs/field-recovery.md)."""

from __future__ import annotations

from typing import Any

from doubles.superagent_agent import answer_for
from fieldrecovery.assembly import assemble
from fieldrecovery.eml import parse_eml
from fieldrecovery.projector import project
from fieldrecovery.request_builder import build_request
from fieldrecovery.resolver import resolve_dependencies
from fieldrecovery.schemas import (
    FactStatus,
    Provenance,
    RecoveryPatch,
    RecoveryPatchSet,
    RecoveryRequestSet,
    RecoveryTask,
    UnresolvedTask,
)
from fieldrecovery.validator import validate_patch_set
from tests.field_helpers import sample_eml

FACTS = parse_eml(sample_eml("ambiguous"))
REQUEST = build_request(FACTS, profile_version="pv1")
assert REQUEST is not None


def _patch(task_id: str = "task-room_type", **changes: Any) -> RecoveryPatch:
    base = {
        "task-room_type": dict(field="room_type", value="Deluxe King", evidence_refs=["L7"], candidate_ref="C3"),
        "task-arrival_date": dict(
            field="arrival_date", value="2026-03-05", evidence_refs=["L5", "H:date"], candidate_ref="C1"
        ),
        "task-departure_date": dict(
            field="departure_date", value="2026-03-07", evidence_refs=["L6"], candidate_ref="C1"
        ),
    }[task_id]
    fields = {"task_id": task_id, "path": f"booking.{base['field']}", "confidence": 0.8, **base, **changes}
    return RecoveryPatch(**fields)


def _set(*patches: RecoveryPatch, request: RecoveryRequestSet = REQUEST, **changes: Any) -> RecoveryPatchSet:
    fields = {
        "schema_version": request.schema_version,
        "request_id": request.request_id,
        "attempt": request.attempt,
        "idempotency_key": request.idempotency_key,
        "patches": list(patches),
        "unresolved": [],
        **changes,
    }
    return RecoveryPatchSet(**fields)


def _reasons(patch_set: RecoveryPatchSet) -> dict[str, str]:
    _, rejected = validate_patch_set(REQUEST, patch_set)
    return {r.task_id: r.reason for r in rejected}


def test_correct_patches_are_all_valid() -> None:
    valid, rejected = validate_patch_set(
        REQUEST, _set(_patch("task-arrival_date"), _patch("task-departure_date"), _patch())
    )
    assert rejected == [] and len(valid) == 3


def test_identity_mismatch_rejects_every_patch() -> None:
    for changes, reason in (
        ({"request_id": "frq_other"}, "request_id_mismatch"),
        ({"attempt": 2}, "attempt_mismatch"),
        ({"idempotency_key": "0" * 64}, "idempotency_key_mismatch"),
        ({"schema_version": "2"}, "schema_version_mismatch"),
    ):
        valid, rejected = validate_patch_set(REQUEST, _set(_patch(), _patch("task-arrival_date"), **changes))
        assert valid == [] and [r.reason for r in rejected] == [reason, reason]


def test_each_patch_rule_has_its_reason() -> None:
    cases = {
        "unknown_task": _patch().model_copy(update={"task_id": "task-guest_name"}),
        "field_mismatch": _patch(field="guest_name"),
        "path_mismatch": _patch(path="booking.guest_name"),
        "evidence_refs_empty": _patch(evidence_refs=[]),
        "evidence_ref_unknown": _patch(evidence_refs=["L7", "L99"]),
        "candidate_ref_missing": _patch(candidate_ref=None),
        "candidate_ref_unknown": _patch(candidate_ref="C9"),
        "candidate_value_mismatch": _patch(value="Junior Suite"),
    }
    for reason, patch in cases.items():
        assert _reasons(_set(patch)) == {patch.task_id: reason}, reason


def test_value_must_match_the_value_schema_even_when_a_candidate_carries_it() -> None:
    task = REQUEST.tasks[0].model_copy(
        update={"candidates": [c.model_copy(update={"value": "2026-02-30"}) for c in REQUEST.tasks[0].candidates]}
    )
    request = REQUEST.model_copy(update={"tasks": [task]})
    bad = _patch("task-arrival_date", value="2026-02-30")
    _, rejected = validate_patch_set(request, _set(bad, request=request))
    assert [r.reason for r in rejected] == ["value_schema_mismatch"]


def test_duplicate_task_and_patch_also_declared_unresolved_are_rejected() -> None:
    assert _reasons(_set(_patch(), _patch())) == {"task-room_type": "duplicate_task"}
    declared = _set(_patch(), unresolved=[UnresolvedTask(task_id="task-room_type", reason="unsure")])
    assert _reasons(declared) == {"task-room_type": "task_also_unresolved"}


def test_patch_whose_dependency_stays_unresolved_is_rejected_with_its_chain() -> None:
    bad_arrival = _patch("task-arrival_date", value="2026-05-03")  # C1's value is 2026-03-05
    result = assemble(REQUEST, _set(bad_arrival, _patch("task-departure_date"), _patch()))
    assert [p.task_id for p in result.accepted] == ["task-room_type"]
    assert {r.task_id: r.reason for r in result.rejected} == {
        "task-arrival_date": "candidate_value_mismatch",
        "task-departure_date": "dependency_unresolved",
    }


def test_dependency_cycles_are_rejected() -> None:
    def task(task_id: str, deps: list[str]) -> RecoveryTask:
        return REQUEST.tasks[2].model_copy(update={"task_id": task_id, "depends_on": deps})

    request = REQUEST.model_copy(
        update={"tasks": [task("a", ["b"]), task("b", ["a"]), task("c", ["a"]), task("d", ["d"]), task("e", [])]}
    )
    valid = [_patch().model_copy(update={"task_id": t}) for t in "abcde"]
    accepted, rejected = resolve_dependencies(request, valid)
    assert [p.task_id for p in accepted] == ["e"]
    assert {r.task_id: r.reason for r in rejected} == {
        "a": "dependency_cycle",
        "b": "dependency_cycle",
        "c": "dependency_cycle",
        "d": "dependency_cycle",
    }


def test_projection_marks_recovered_facts_and_keeps_parser_facts() -> None:
    result = assemble(REQUEST, _set(_patch("task-arrival_date"), _patch("task-departure_date"), _patch()))
    view = project(FACTS, result)
    assert view.fact("arrival_date").value == "2026-03-05"
    assert view.fact("arrival_date").provenance == Provenance.RECOVERY
    assert view.fact("room_type").evidence_refs == ["L7"]
    assert view.fact("guest_name").provenance == Provenance.PARSER
    assert view.fact("guest_name").value == "Jane Doe"
    assert view.idempotency_key == REQUEST.idempotency_key


def test_rejected_patch_never_changes_a_parser_fact() -> None:
    result = assemble(REQUEST, _set(_patch(value="Junior Suite", candidate_ref="C4", evidence_refs=["L99"])))
    view = project(FACTS, result)
    assert view.fact("room_type").status == FactStatus.UNRESOLVED
    assert view.fact("room_type").value is None
    assert view.fact("room_type").provenance == Provenance.PARSER
    # Even an "accepted" patch aimed at a RESOLVED parser fact is ignored by the projector.
    forged = result.model_copy(
        update={"accepted": [_patch().model_copy(update={"task_id": "task-guest_name", "field": "guest_name"})]}
    )
    assert project(FACTS, forged).fact("guest_name").value == "Jane Doe"


def test_baseline_projection_is_the_parser_verdict() -> None:
    view = project(FACTS)
    assert view.idempotency_key is None
    assert all(f.provenance == Provenance.PARSER for f in view.facts)
    assert view.fact("arrival_date").status == FactStatus.UNRESOLVED


def test_unresolved_from_an_answer_for_another_request_is_dropped() -> None:
    result = assemble(
        REQUEST,
        _set(unresolved=[UnresolvedTask(task_id="task-room_type", reason="x")], request_id="frq_other"),
    )
    assert result.unresolved == []


def test_the_stand_in_agent_answers_the_samples_correctly() -> None:
    result = assemble(REQUEST, answer_for(REQUEST))
    assert result.rejected == []
    assert {p.field: p.value for p in result.accepted} == {
        "arrival_date": "2026-03-05",
        "departure_date": "2026-03-07",
        "room_type": "Deluxe King",
    }
    multipart = build_request(parse_eml(sample_eml("multipart")), profile_version="pv1")
    assert multipart is not None
    result = assemble(multipart, answer_for(multipart))
    assert {p.field: p.value for p in result.accepted} == {"arrival_date": "2026-06-01"}
    assert [(u.task_id, u.reason) for u in result.unresolved] == [("task-room_type", "ambiguous")]
