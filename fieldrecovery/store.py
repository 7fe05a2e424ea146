"""Invocation store: one persistent owner per idempotency key, replay, apply-once (docs/state-machines.md).

State machine of ``field_recovery_invocation.status``::

    (no row) --claim--> IN_PROGRESS --finish_success--> SUCCEEDED --put_assembly (once)-->
                        IN_PROGRESS --finish_failure--> FAILED
                        IN_PROGRESS --take over (expired lease, stale_takeover on)--> IN_PROGRESS, epoch+1

* claim reads the row; when there is none it tries ``INSERT ... ON CONFLICT (idempotency_key) DO
  NOTHING``: exactly one caller inserts and owns the key; every other caller reads the row and
  replays (SUCCEEDED/FAILED) or waits (BUSY). The pipeline's artifacts written before the call
  go in the claim's transaction.
* finish_* are ONE conditional UPDATE from IN_PROGRESS naming the owner and the epoch it holds;
  rowcount 0 means a newer owner (or an earlier finish) won, and nothing is written.
* The owner renews its lease while the provider call runs. Only with ``stale_takeover`` may an
  IN_PROGRESS row whose lease expired be taken over, by a CAS that bumps the epoch: the dead (or
  paused) owner's later writes name the old epoch and land nowhere (fencing).
* put_assembly is put-if-absent: the first assembly is stored with its artifacts in the same
  transaction; later callers get the stored one back (apply-once).
* A STALE invocation is IN_PROGRESS past its lease: its owner died (or hangs) and, with takeover
  off, every redelivery of its key waits out its whole deadline. ``stale()`` lists them and
  ``release`` ends one: IN_PROGRESS -> FAILED (``released_stale``, with the operator's reason),
  ONE conditional UPDATE that names the epoch and an expired lease, so a live or newer owner is
  never touched; a late write of the old owner lands nowhere (it names IN_PROGRESS). Replays of
  the key then fail closed at once; a new attempt (``--attempt N+1``) calls the provider.

Lease times use the database clock (``now()``), so workers with skewed clocks agree.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from functools import lru_cache
from typing import Any, cast

from sqlalchemy import Connection, CursorResult, Engine, Row, Select, bindparam, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from fieldrecovery.artifacts import ArtifactDraft, put_artifacts, stored_markers, stored_markers_params
from fieldrecovery.errors import FieldRecoveryError, StoreUnavailable, ValueRejected
from fieldrecovery.records import InvocationMeta, InvocationRecord, ProviderAudit, StaleInvocation
from fieldrecovery.tables import (
    DEFAULT_RETENTION_DAYS,
    DEFAULT_SCHEMA,
    FieldRecoveryInvocation,
    InvocationStatus,
)
from logfmt import log_event
from models.db import get_engine

log = logging.getLogger(__name__)
Inv = FieldRecoveryInvocation


class ClaimOutcome(StrEnum):
    CLAIMED = "CLAIMED"  #: this caller inserted the row and owns it (epoch 1)
    TAKEN_OVER = "TAKEN_OVER"  #: this caller fenced out an expired owner (epoch + 1)
    SUCCEEDED = "SUCCEEDED"  #: already succeeded: replay the stored PatchSet / assembly
    FAILED = "FAILED"  #: already failed closed: replay the failure, no provider call
    BUSY = "BUSY"  #: another owner holds a live (or, takeover off, any) IN_PROGRESS row


class ReleaseOutcome(StrEnum):
    RELEASED = "RELEASED"  #: IN_PROGRESS -> FAILED (released_stale); the key's replays fail at once
    NOT_FOUND = "NOT_FOUND"  #: no invocation has this key
    FINISHED = "FINISHED"  #: already SUCCEEDED or FAILED: nothing to release
    LEASE_LIVE = "LEASE_LIVE"  #: an owner still renews its lease: never released under it
    EPOCH_MOVED = "EPOCH_MOVED"  #: a newer owner took the key over since the epoch named


#: error_code of an invocation released by an operator.
RELEASED_CODE = "released_stale"


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    #: The epoch this caller now holds (CLAIMED / TAKEN_OVER); every owner write names it.
    epoch: int | None = None
    record: InvocationRecord | None = None

    @property
    def owned(self) -> bool:
        return self.outcome in (ClaimOutcome.CLAIMED, ClaimOutcome.TAKEN_OVER)


def rowcount(result: Any) -> int:
    """Rows matched by an UPDATE (a CursorResult; typed loosely by Session.execute)."""
    return int(cast("CursorResult[Any]", result).rowcount)


def new_owner_id() -> str:
    """A unique owner id: host, pid and a random suffix (one per recovery call)."""
    return f"{socket.gethostname()[:60]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


#: The columns of an InvocationRecord, read as plain columns (no ORM object is built).
_RECORD_COLUMNS = (
    Inv.idempotency_key,
    Inv.request_id,
    Inv.status,
    Inv.owner_id,
    Inv.epoch,
    Inv.lease_expires_at,
    Inv.error_code,
    Inv.patch_set,
    Inv.assembly_result,
    Inv.provider_run_id,
    Inv.duration_ms,
)


def _record(row: Row[Any]) -> InvocationRecord:
    return InvocationRecord(
        idempotency_key=row.idempotency_key,
        request_id=row.request_id,
        status=InvocationStatus(row.status),
        owner_id=row.owner_id,
        epoch=row.epoch,
        lease_expires_at=row.lease_expires_at,
        error_code=row.error_code,
        patch_set=row.patch_set,
        assembly_result=row.assembly_result,
        provider_run_id=row.provider_run_id,
        duration_ms=row.duration_ms,
    )


#: The row of one key (built once: the hot path only binds ``key``).
_READ = select(*_RECORD_COLUMNS).where(Inv.idempotency_key == bindparam("key"))


def _read(conn: Connection, key: str) -> InvocationRecord | None:
    row = conn.execute(_READ, {"key": key}).one_or_none()
    return None if row is None else _record(row)


@lru_cache(maxsize=8)
def _read_with_artifacts(count: int) -> Select[Any]:
    """One row always: which of ``count`` artifacts are stored (an aggregate), with the
    invocation of ``key`` left-joined to it (its columns NULL when there is none)."""
    markers = select(stored_markers(count).label("stored_markers")).subquery("stored")
    return select(markers.c.stored_markers, *_RECORD_COLUMNS).select_from(
        markers.outerjoin(Inv, Inv.idempotency_key == bindparam("key"))
    )


class InvocationStore:
    """The field_recovery_invocation table in ``schema`` of the database at ``url``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        schema: str = DEFAULT_SCHEMA,
        lease_seconds: float = 30.0,
        retention_days: int = DEFAULT_RETENTION_DAYS,
    ) -> None:
        self.url = url
        self.schema = schema
        self.lease = timedelta(seconds=lease_seconds)
        self.lease_seconds = lease_seconds
        self.retention = timedelta(days=retention_days)
        self._engine: Engine | None = None

    # --- plumbing --------------------------------------------------------------------------

    def engine(self) -> Engine:
        if self._engine is None:
            engine = get_engine(self.url)
            if engine.dialect.name != "postgresql":
                raise StoreUnavailable("field recovery needs PostgreSQL", code="store_needs_postgresql")
            if self.schema != DEFAULT_SCHEMA:
                engine = engine.execution_options(schema_translate_map={DEFAULT_SCHEMA: self.schema})
            self._engine = engine
        return self._engine

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """One ORM Session, one transaction; database errors become StoreUnavailable (safe text)."""
        with self._translated(), Session(self.engine(), expire_on_commit=False) as session, session.begin():
            yield session

    @contextmanager
    def connection(self, *, autocommit: bool = False) -> Iterator[Connection]:
        """One Core connection (the store's own statements: no ORM on the hot path), one
        transaction, or with ``autocommit`` one per statement; database errors become
        StoreUnavailable (safe text), as in ``transaction``."""
        with self._translated():
            if autocommit:
                with self.engine().connect() as conn:
                    yield conn.execution_options(isolation_level="AUTOCOMMIT")
            else:
                with self.engine().begin() as conn:
                    yield conn

    @staticmethod
    @contextmanager
    def _translated() -> Iterator[None]:
        try:
            yield
        except FieldRecoveryError:
            raise
        except SQLAlchemyError as exc:
            pgcode = getattr(getattr(exc, "orig", None), "pgcode", None) or ""
            if pgcode in ("42P01", "3F000"):
                raise StoreUnavailable(
                    f"database error ({type(exc).__name__}, sqlstate {pgcode}); "
                    "is migration 0004 applied (agent-recovery db upgrade)?",
                    code="store_schema_missing",
                ) from None
            if pgcode.startswith("22"):  # data exception: a value out of range, too long, badly encoded
                raise ValueRejected(f"the database refused a value (sqlstate {pgcode})") from None
            raise StoreUnavailable(f"database error ({type(exc).__name__}, sqlstate {pgcode or '-'})") from None
        except ValueError:
            # NOTE: psycopg2 refuses a NUL in a string parameter with a bare ValueError, before
            # anything reaches the server; SQLAlchemy does not wrap it.
            raise ValueRejected("the database driver refused a value (a NUL character)") from None

    # --- claim and ownership ---------------------------------------------------------------

    def claim(
        self,
        meta: InvocationMeta,
        owner_id: str,
        *,
        stale_takeover: bool,
        artifacts: Sequence[ArtifactDraft] = (),
    ) -> Claim:
        """Read-or-insert claim; ``artifacts`` (the pipeline's, before any call) are written first
        unless stored already.

        ONE statement reads the row and which of the artifacts are stored: a replay or a
        waiting caller (the row exists, the artifacts too) costs that one statement and writes
        nothing. Only when no row is visible is the insert tried, and its ``ON CONFLICT DO
        NOTHING`` still decides who owns the key: a caller that loses that race reads the
        winner's row. Every statement here is its own transaction (autocommit): each one is
        atomic alone, none depends on another's snapshot (under READ COMMITTED each statement
        has its own anyway), and a replay saves the COMMIT round trip. See the module
        docstring for the outcomes.
        """
        key = meta.idempotency_key
        drafts = [d.hashed() for d in artifacts]
        with self.connection(autocommit=True) as conn:
            record, stored = self._read_for_claim(conn, key, drafts)
            put_artifacts(conn, [d for d in drafts if d.marker not in stored], retention=self.retention)
            if record is None:
                inserted = conn.execute(self._insert(meta, owner_id)).scalar_one_or_none()
                if inserted is not None:
                    claim = Claim(ClaimOutcome.CLAIMED, epoch=inserted)
                else:  # NOTE: a concurrent claim inserted and committed after our read
                    record = _read(conn, key)
                    if record is None:  # (and a purge removed it since: nothing to own or replay)
                        raise StoreUnavailable("the invocation vanished during its claim", code="claim_raced")
            if record is not None:
                claim = self._existing(conn, record, owner_id, stale_takeover)
        log_event(
            log,
            "claim",
            key=key,
            request_id=meta.request_id,
            outcome=claim.outcome.value,
            epoch=claim.epoch if claim.owned else (claim.record.epoch if claim.record else None),
        )
        return claim

    @staticmethod
    def _read_for_claim(
        conn: Connection, key: str, drafts: Sequence[ArtifactDraft]
    ) -> tuple[InvocationRecord | None, set[str]]:
        """(the row or None, markers of the drafts already stored), in one statement."""
        if not drafts:
            return _read(conn, key), set()
        row = conn.execute(_read_with_artifacts(len(drafts)), {"key": key, **stored_markers_params(drafts)}).one()
        record = None if row.idempotency_key is None else _record(row)
        return record, set(row.stored_markers or ())

    def _insert(self, meta: InvocationMeta, owner_id: str) -> Any:
        now = func.now()
        return (
            pg_insert(Inv)
            .values(
                idempotency_key=meta.idempotency_key,
                request_id=meta.request_id,
                attempt=meta.attempt,
                source_message_id=meta.source_message_id,
                source_revision=meta.source_revision,
                observation_hash=meta.observation_hash,
                profile_version=meta.profile_version,
                request_hash=meta.request_hash,
                status=InvocationStatus.IN_PROGRESS.value,
                owner_id=owner_id,
                epoch=1,
                lease_expires_at=now + self.lease,
                created_at=now,
                started_at=now,
                updated_at=now,
                retention_until=now + self.retention,
            )
            .on_conflict_do_nothing(index_elements=[Inv.idempotency_key])
            .returning(Inv.epoch)
        )

    def _existing(self, conn: Connection, record: InvocationRecord, owner_id: str, stale_takeover: bool) -> Claim:
        key = record.idempotency_key
        if record.status == InvocationStatus.SUCCEEDED:
            return Claim(ClaimOutcome.SUCCEEDED, record=record)
        if record.status == InvocationStatus.FAILED:
            return Claim(ClaimOutcome.FAILED, record=record)
        if not stale_takeover:
            return Claim(ClaimOutcome.BUSY, record=record)
        # NOTE: two takers that both saw this epoch race on the row lock; the second re-checks
        # the WHERE after the first committed, sees the new epoch and updates nothing.
        now = func.now()
        taken = conn.execute(
            update(Inv)
            .where(
                Inv.idempotency_key == key,
                Inv.status == InvocationStatus.IN_PROGRESS.value,
                Inv.epoch == record.epoch,
                Inv.lease_expires_at < now,
            )
            .values(
                owner_id=owner_id,
                epoch=Inv.epoch + 1,
                lease_expires_at=now + self.lease,
                started_at=now,
                updated_at=now,
                # The dead owner's ids go with the old epoch: its run is the taker's to cancel
                # (from the record read above), never a later taker's again.
                provider_session_id=None,
                provider_run_id=None,
            )
            .returning(Inv.epoch)
        ).scalar_one_or_none()
        if taken is None:
            return Claim(ClaimOutcome.BUSY, record=record)
        log_event(log, "takeover", key=key, old_epoch=record.epoch, epoch=taken)
        return Claim(ClaimOutcome.TAKEN_OVER, epoch=taken, record=record)

    def note_run(self, key: str, owner_id: str, epoch: int, *, session_id: str, run_id: str) -> bool:
        """Record the platform's session and run ids on the owner's row as soon as they are known,
        so that a stale takeover or a release can cancel the run of an owner that died.

        False, nothing done: the owner lost the row (finished, released, or fenced out).
        """
        with self.connection() as conn:
            rows = rowcount(
                conn.execute(
                    update(Inv)
                    .where(*self._owned_by(key, owner_id, epoch))
                    .values(provider_session_id=session_id[:128], provider_run_id=run_id[:128], updated_at=func.now())
                )
            )
        return rows == 1

    def renew_lease(self, key: str, owner_id: str, epoch: int) -> bool:
        """Extend the owner's lease; False when the owner lost the row (finished or fenced)."""
        with self.connection() as conn:
            rows = rowcount(
                conn.execute(
                    update(Inv)
                    .where(*self._owned_by(key, owner_id, epoch))
                    .values(lease_expires_at=func.now() + self.lease, updated_at=func.now())
                )
            )
        return rows == 1

    def finish_success(
        self, key: str, owner_id: str, epoch: int, patch_set: dict[str, Any], audit: ProviderAudit
    ) -> bool:
        """IN_PROGRESS -> SUCCEEDED by the owner at ``epoch``; False when that owner lost the row."""
        return self._finish(key, owner_id, epoch, status=InvocationStatus.SUCCEEDED, patch_set=patch_set, audit=audit)

    def finish_failure(
        self, key: str, owner_id: str, epoch: int, *, code: str, summary: str, audit: ProviderAudit
    ) -> bool:
        """IN_PROGRESS -> FAILED by the owner at ``epoch``; False when that owner lost the row."""
        return self._finish(
            key,
            owner_id,
            epoch,
            status=InvocationStatus.FAILED,
            error_code=code[:64],
            error_summary=summary[:512],
            audit=audit,
        )

    def _finish(self, key: str, owner_id: str, epoch: int, *, status: InvocationStatus, **values: Any) -> bool:
        audit: ProviderAudit = values.pop("audit")
        with self.connection() as conn:
            rows = rowcount(
                conn.execute(
                    update(Inv)
                    .where(*self._owned_by(key, owner_id, epoch))
                    .values(
                        status=status.value,
                        completed_at=func.now(),
                        updated_at=func.now(),
                        lease_expires_at=None,
                        **audit.columns(),
                        **values,
                    )
                )
            )
        landed = rows == 1
        if not landed:
            log_event(log, "finish_lost", key=key, epoch=epoch, status=status.value)
        return landed

    @staticmethod
    def _owned_by(key: str, owner_id: str, epoch: int) -> Sequence[Any]:
        return (
            Inv.idempotency_key == key,
            Inv.status == InvocationStatus.IN_PROGRESS.value,
            Inv.owner_id == owner_id,
            Inv.epoch == epoch,
        )

    # --- assembly: put-if-absent -----------------------------------------------------------

    def put_assembly(
        self, key: str, assembly: dict[str, Any], artifacts: Sequence[ArtifactDraft] = ()
    ) -> tuple[bool, dict[str, Any]]:
        """Store the assembly (and its artifacts, same transaction) unless one is stored.

        Returns (written, stored assembly). Raises FieldRecoveryError when the invocation has
        not succeeded (there is nothing to assemble).
        """
        with self.connection() as conn:
            rows = rowcount(
                conn.execute(
                    update(Inv)
                    .where(
                        Inv.idempotency_key == key,
                        Inv.status == InvocationStatus.SUCCEEDED.value,
                        Inv.assembly_result.is_(None),
                    )
                    .values(assembly_result=assembly, assembled_at=func.now(), updated_at=func.now())
                )
            )
            if rows == 1:
                put_artifacts(conn, artifacts, retention=self.retention)
                return True, assembly
            stored = conn.execute(
                select(Inv.status, Inv.assembly_result).where(Inv.idempotency_key == key)
            ).one_or_none()
        if stored is None or stored.assembly_result is None:
            raise FieldRecoveryError("the invocation has not succeeded; nothing to assemble", code="not_succeeded")
        return False, stored.assembly_result

    # --- stale invocations (operators) -----------------------------------------------------

    def stale(self, limit: int = 100) -> list[StaleInvocation]:
        """IN_PROGRESS invocations past their lease, longest overdue first."""
        now = func.now()
        with self.transaction() as s:
            rows = s.execute(
                select(
                    Inv.idempotency_key,
                    Inv.request_id,
                    Inv.owner_id,
                    Inv.epoch,
                    Inv.started_at,
                    Inv.lease_expires_at,
                    func.extract("epoch", now - Inv.started_at).label("age"),
                    func.extract("epoch", now - Inv.lease_expires_at).label("overdue"),
                )
                .where(*self._stale())
                .order_by(Inv.lease_expires_at)
                .limit(limit)
            ).all()
        return [
            StaleInvocation(
                idempotency_key=r.idempotency_key,
                request_id=r.request_id,
                owner_id=r.owner_id,
                epoch=r.epoch,
                started_at=r.started_at,
                lease_expires_at=r.lease_expires_at,
                age_seconds=float(r.age),
                overdue_seconds=float(r.overdue),
            )
            for r in rows
        ]

    def count_stale(self) -> int:
        with self.transaction() as s:
            return int(s.execute(select(func.count()).select_from(Inv).where(*self._stale())).scalar_one())

    @staticmethod
    def _stale() -> Sequence[Any]:
        # Served by the partial index ix_field_recovery_invocation_in_progress.
        return (Inv.status == InvocationStatus.IN_PROGRESS.value, Inv.lease_expires_at < func.now())

    def release(self, key: str, *, reason: str, epoch: int | None = None) -> ReleaseOutcome:
        """Fail a stale invocation (module docstring); ``epoch`` defaults to the one stored now.

        Without ``epoch`` the row's current epoch is read first and named in the UPDATE: a
        takeover between the two bumps it, and the release then lands nowhere (EPOCH_MOVED).
        """
        return self.release_run(key, reason=reason, epoch=epoch)[0]

    def release_run(self, key: str, *, reason: str, epoch: int | None = None) -> tuple[ReleaseOutcome, str | None]:
        """``release``, and the dead owner's platform run id when it was recorded (to cancel)."""
        run_id: str | None = None
        with self.transaction() as s:
            if epoch is None:
                epoch = s.execute(select(Inv.epoch).where(Inv.idempotency_key == key)).scalar_one_or_none()
                if epoch is None:
                    return ReleaseOutcome.NOT_FOUND, None
            released = s.execute(
                update(Inv)
                .where(Inv.idempotency_key == key, Inv.epoch == epoch, *self._stale())
                .values(
                    status=InvocationStatus.FAILED.value,
                    error_code=RELEASED_CODE,
                    error_summary=f"released by an operator: {reason}"[:512],
                    completed_at=func.now(),
                    updated_at=func.now(),
                    lease_expires_at=None,
                )
                .returning(Inv.provider_run_id)
                .execution_options(synchronize_session=False)
            ).all()
            if len(released) == 1:
                run_id = released[0][0]
                outcome = ReleaseOutcome.RELEASED
            else:  # why not: a read for the operator's message only, nothing is decided on it
                row = s.execute(
                    select(Inv.status, Inv.epoch, Inv.lease_expires_at < func.now()).where(Inv.idempotency_key == key)
                ).one_or_none()
                if row is None:
                    outcome = ReleaseOutcome.NOT_FOUND
                elif row[0] != InvocationStatus.IN_PROGRESS.value:
                    outcome = ReleaseOutcome.FINISHED
                elif row[1] != epoch:
                    outcome = ReleaseOutcome.EPOCH_MOVED
                else:
                    outcome = ReleaseOutcome.LEASE_LIVE
        log_event(log, "release", key=key, epoch=epoch, outcome=outcome.value, run_id=run_id)
        return outcome, run_id

    # --- reads -----------------------------------------------------------------------------

    def get(self, key: str) -> InvocationRecord | None:
        with self.connection() as conn:
            return _read(conn, key)


def store_from_settings(url: str | None = None) -> InvocationStore:
    """The store the process settings name (schema, lease, retention)."""
    from settings import get_settings

    fr = get_settings().booking_field_recovery
    return InvocationStore(url, schema=fr.db_schema, lease_seconds=fr.lease_seconds, retention_days=fr.retention_days)


def list_stale(url: str | None = None, *, limit: int = 100) -> list[StaleInvocation]:
    """Stale IN_PROGRESS invocations of the configured database (``agent-recovery field stale``)."""
    return store_from_settings(url).stale(limit)


def stale_count(url: str | None = None) -> int:
    """How many invocations are IN_PROGRESS past their lease (for ``agent-recovery status``).

    0 on a database other than PostgreSQL (field recovery cannot run there); raises
    StoreUnavailable (a FieldRecoveryError) when PostgreSQL or the field tables are unusable.
    """
    try:
        return store_from_settings(url).count_stale()
    except StoreUnavailable as exc:
        if exc.code == "store_needs_postgresql":
            return 0
        raise


class LeaseSignal:
    """Set when the owner must stop: its lease was taken, or a full lease passed unconfirmed.

    ``is_set`` also turns true on its own once ``lease_seconds`` have passed since the last
    CONFIRMED renewal (measured from the moment that renewal was sent, on the local monotonic
    clock, so the owner stops no later than the database's lease runs out). It does not need
    the renewal thread to run: a renewal blocked on an unreachable database cannot delay it.
    """

    def __init__(self, lease_seconds: float, confirmed_at: float) -> None:
        self._event = threading.Event()
        self._lease_seconds = lease_seconds
        self._confirmed_at = confirmed_at

    def confirm(self, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` (monotonic) was confirmed by the database."""
        self._confirmed_at = max(self._confirmed_at, sent_at)

    def unconfirmed_left(self) -> float:
        """Seconds until a full lease has passed without a confirmed renewal."""
        return self._confirmed_at + self._lease_seconds - time.monotonic()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set() or self.unconfirmed_left() <= 0

    def wait(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not self.is_set():
            left = min(end - time.monotonic(), max(self.unconfirmed_left(), 0.0) + 0.001)
            if left <= 0:
                return self.is_set()
            self._event.wait(min(left, 0.05))
        return True


class LeaseKeeper:
    """Renews the owner's lease every third of its length while the provider call runs.

    ``lost`` is set when a renewal finds the row no longer ours (a newer epoch took it over),
    and turns set by itself once a full lease has passed without a confirmed renewal (the
    database unreachable: with ``stale_takeover`` another worker may own the key by then). The
    owner then stops its call (and cancels the run): one provider call per key.
    """

    def __init__(
        self, store: InvocationStore, key: str, owner_id: str, epoch: int, *, claimed_at: float | None = None
    ) -> None:
        """``claimed_at``: monotonic time at which the claim was SENT (default: now)."""
        self.store, self.key, self.owner_id, self.epoch = store, key, owner_id, epoch
        self.lost = LeaseSignal(store.lease_seconds, time.monotonic() if claimed_at is None else claimed_at)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="field-lease", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        interval = max(self.store.lease_seconds / 3, 0.05)
        while not self._stop.wait(min(interval, max(self.lost.unconfirmed_left(), 0.0))):
            if self.lost.is_set():
                log_event(log, "lease_unconfirmed", key=self.key, epoch=self.epoch)
                return
            sent_at = time.monotonic()
            try:
                if not self.store.renew_lease(self.key, self.owner_id, self.epoch):
                    self.lost.set()
                    log_event(log, "lease_lost", key=self.key, epoch=self.epoch)
                    return
                self.lost.confirm(sent_at)
            except FieldRecoveryError as exc:  # transient: the next tick tries again, within the lease
                log_event(log, "lease_renew_failed", key=self.key, error_code=exc.code)
