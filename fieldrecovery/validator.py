"""RecoveryPatchValidator: a provider answer never becomes a fact without passing here.

Checks (docs/field-recovery.md, step 6): the patch set's identity (schema version, request id, attempt,
idempotency key) equals the request's; each patch names a task of the request, at most once,
with the task's field and path; its evidence refs are non-empty and all among the task's; its
candidate ref is among the task's candidates and that candidate's value equals the patch value;
the value matches the task's value schema. A patch that fails is rejected with the first
failing reason; the others go on to the dependency resolver.
"""

from __future__ import annotations

from collections import Counter

from fieldrecovery.schemas import (
    RecoveryPatch,
    RecoveryPatchSet,
    RecoveryRequestSet,
    RecoveryTask,
    Rejection,
    value_matches,
)


def validate_patch_set(
    request: RecoveryRequestSet, patch_set: RecoveryPatchSet
) -> tuple[list[RecoveryPatch], list[Rejection]]:
    """Split the patches into (valid, rejected); rejections keep the patches' order."""
    identity = identity_error(request, patch_set)
    if identity is not None:
        return [], [Rejection(task_id=p.task_id, reason=identity) for p in patch_set.patches]
    tasks = {t.task_id: t for t in request.tasks}
    counts = Counter(p.task_id for p in patch_set.patches)
    declared_unresolved = {u.task_id for u in patch_set.unresolved}
    valid: list[RecoveryPatch] = []
    rejected: list[Rejection] = []
    for patch in patch_set.patches:
        reason = _patch_error(patch, tasks.get(patch.task_id), counts[patch.task_id], declared_unresolved)
        if reason is None:
            valid.append(patch)
        else:
            rejected.append(Rejection(task_id=patch.task_id, reason=reason))
    return valid, rejected


def identity_error(request: RecoveryRequestSet, patch_set: RecoveryPatchSet) -> str | None:
    """The reason the patch set as a whole belongs to another request, or None."""
    if patch_set.schema_version != request.schema_version:
        return "schema_version_mismatch"
    if patch_set.request_id != request.request_id:
        return "request_id_mismatch"
    if patch_set.attempt != request.attempt:
        return "attempt_mismatch"
    if patch_set.idempotency_key != request.idempotency_key:
        return "idempotency_key_mismatch"
    return None


def _patch_error(
    patch: RecoveryPatch, task: RecoveryTask | None, count: int, declared_unresolved: set[str]
) -> str | None:
    if task is None:
        return "unknown_task"
    if count > 1:
        return "duplicate_task"
    if patch.task_id in declared_unresolved:
        return "task_also_unresolved"
    if patch.field != task.field:
        return "field_mismatch"
    if patch.path != task.path:
        return "path_mismatch"
    if not patch.evidence_refs:
        return "evidence_refs_empty"
    evidence = {e.ref for e in task.evidence}
    if any(ref not in evidence for ref in patch.evidence_refs):
        return "evidence_ref_unknown"
    if task.candidates:
        if patch.candidate_ref is None:
            return "candidate_ref_missing"
        candidates = {c.ref: c.value for c in task.candidates}
        if patch.candidate_ref not in candidates:
            return "candidate_ref_unknown"
        if candidates[patch.candidate_ref] != patch.value:
            return "candidate_value_mismatch"
    elif patch.candidate_ref is not None:
        return "candidate_ref_unknown"
    if not value_matches(task.value_schema, patch.value):
        return "value_schema_mismatch"
    return None
