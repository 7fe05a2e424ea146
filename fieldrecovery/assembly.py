"""Assembly: validator, then dependency resolver, into one AssemblyResult with reasons.

The result is deterministic in (request, patch set): any caller that assembles the same
invocation gets the same result, which is what makes put-if-absent of the assembly safe.
"""

from __future__ import annotations

from fieldrecovery.resolver import resolve_dependencies
from fieldrecovery.schemas import AssemblyResult, RecoveryPatchSet, RecoveryRequestSet
from fieldrecovery.validator import identity_error, validate_patch_set


def assemble(request: RecoveryRequestSet, patch_set: RecoveryPatchSet) -> AssemblyResult:
    valid, rejected = validate_patch_set(request, patch_set)
    accepted, fallen = resolve_dependencies(request, valid)
    tasks = {t.task_id for t in request.tasks}
    # An answer for another request says nothing about this one's tasks.
    trusted = identity_error(request, patch_set) is None
    return AssemblyResult(
        request_id=request.request_id,
        idempotency_key=request.idempotency_key,
        accepted=accepted,
        rejected=rejected + fallen,
        unresolved=[u for u in patch_set.unresolved if trusted and u.task_id in tasks],
    )
