"""Projector: parser facts + accepted patches -> EffectiveFactView, each fact with provenance.

Only an UNRESOLVED + RECOVERABLE parser fact can take a recovered value, and only from an
accepted patch for its own task and path; a RESOLVED parser fact is never changed, whatever
the assembly says. Everything else keeps the parser's verdict (provenance PARSER).
"""

from __future__ import annotations

from fieldrecovery.request_builder import task_id_of
from fieldrecovery.schemas import (
    AssemblyResult,
    EffectiveFact,
    EffectiveFactView,
    FactStatus,
    ParsedFactSet,
    Provenance,
    Recoverability,
)


def project(facts: ParsedFactSet, assembly: AssemblyResult | None = None) -> EffectiveFactView:
    """The effective view; without an assembly it is the parser-only baseline."""
    accepted = {p.task_id: p for p in assembly.accepted} if assembly is not None else {}
    out = []
    for fact in facts.facts:
        patch = accepted.get(task_id_of(fact.field))
        recoverable = fact.status == FactStatus.UNRESOLVED and fact.recoverability == Recoverability.RECOVERABLE
        if patch is not None and recoverable and patch.path == fact.path and patch.field == fact.field:
            out.append(
                EffectiveFact(
                    path=fact.path,
                    field=fact.field,
                    value=patch.value,
                    status=FactStatus.RESOLVED,
                    provenance=Provenance.RECOVERY,
                    task_id=patch.task_id,
                    evidence_refs=list(patch.evidence_refs),
                )
            )
        else:
            out.append(
                EffectiveFact(
                    path=fact.path,
                    field=fact.field,
                    value=fact.value if fact.status == FactStatus.RESOLVED else None,
                    status=fact.status,
                    provenance=Provenance.PARSER,
                )
            )
    return EffectiveFactView(
        source=facts.source,
        observation_hash=facts.observation_hash,
        idempotency_key=assembly.idempotency_key if assembly is not None else None,
        facts=out,
    )
