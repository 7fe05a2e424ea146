"""Retention: invocations and artifacts past ``retention_until`` are deleted, in batches.

``purge_expired`` runs from the beat task ``field.purge_expired``. Each batch is one transaction
that deletes at most ``batch_size`` rows of one table, claimed with ``FOR UPDATE SKIP LOCKED`` so
two purgers (two beats by mistake) never wait on each other or delete a row twice. Only
finished invocations are purged: an IN_PROGRESS one past its retention is a stale key for an
operator (``agent-recovery field stale``), never silently dropped. Artifacts carry their own
retention_until (their creation + the same retention), so none outlives its invocation by
more than one call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select

from fieldrecovery.store import InvocationStore, rowcount
from fieldrecovery.tables import FieldRecoveryArtifact, FieldRecoveryInvocation, InvocationStatus
from logfmt import log_event

log = logging.getLogger(__name__)
Inv = FieldRecoveryInvocation
Art = FieldRecoveryArtifact

DEFAULT_BATCH_SIZE = 500
#: A bound on one run's work; the next beat goes on where this one stopped.
DEFAULT_MAX_BATCHES = 200
_FINISHED = (InvocationStatus.SUCCEEDED.value, InvocationStatus.FAILED.value)


@dataclass(frozen=True)
class PurgeResult:
    invocations: int
    artifacts: int
    batches: int
    #: True when max_batches stopped the run before everything expired was gone.
    more: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "invocations": self.invocations,
            "artifacts": self.artifacts,
            "batches": self.batches,
            "more": self.more,
        }


def purge_expired(
    store: InvocationStore, *, batch_size: int = DEFAULT_BATCH_SIZE, max_batches: int = DEFAULT_MAX_BATCHES
) -> PurgeResult:
    """Delete expired finished invocations, then expired artifacts, ``batch_size`` rows at a time."""
    counts = {"invocations": 0, "artifacts": 0}
    batches = 0
    more = False
    for table, name in ((Inv, "invocations"), (Art, "artifacts")):
        while True:
            if batches >= max_batches:
                more = True
                break
            deleted = _delete_batch(store, table, batch_size)
            batches += 1
            counts[name] += deleted
            if deleted < batch_size:
                break
    result = PurgeResult(counts["invocations"], counts["artifacts"], batches, more)
    log_event(log, "purge_expired", **result.to_json())
    return result


def _delete_batch(store: InvocationStore, table: type[Inv] | type[Art], batch_size: int) -> int:
    expired = select(table.id).where(table.retention_until < func.now())
    if table is Inv:
        expired = expired.where(Inv.status.in_(_FINISHED))
    expired = expired.order_by(table.retention_until).limit(batch_size).with_for_update(skip_locked=True)
    with store.transaction() as s:
        return rowcount(
            s.execute(
                delete(table)
                .where(table.id.in_(expired.scalar_subquery()))
                .execution_options(synchronize_session=False)
            )
        )
