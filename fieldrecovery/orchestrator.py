"""The MANUAL_EML field-recovery pipeline (docs/field-recovery.md).

EML -> deterministic parser -> PARSED_FACT_SET -> RecoveryRequestBuilder -> no task: parser
baseline, no provider call -> otherwise, under ONE deadline from the claim on: claim the
invocation -> (owner) SuperAgent call -> strict PatchSet -> CAS SUCCEEDED / FAILED ->
validator -> dependency resolver -> projector -> apply-once of the assembly together with the
RECOVERY_ASSEMBLY and EFFECTIVE_FACT_VIEW artifacts -> continue (``next_stage``).

AGENTBUS sources and a disabled configuration never call the provider: they continue with the
parser baseline. Every failure of the call fails closed: the invocation is FAILED with a safe
code, the view is the parser baseline, and no part of the answer is used.

A replay of an applied key is one read (the claim's SELECT) and writes nothing: the stored
assembly is the result (``_replay_assembly`` says why that is safe).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from crashpoints import crash_point
from fieldrecovery.answer import parse_patch_set
from fieldrecovery.artifacts import ArtifactDraft, put_artifacts
from fieldrecovery.assembly import assemble
from fieldrecovery.client import CallProgress, OpenApiClient, ProviderAnswer, client_for
from fieldrecovery.deadline import Deadline
from fieldrecovery.eml import parse_eml
from fieldrecovery.errors import AttemptInvalid, FieldRecoveryError, RequestTooLarge
from fieldrecovery.projector import project
from fieldrecovery.records import InvocationMeta, ProviderAudit
from fieldrecovery.request_builder import build_request, render_message, request_hash
from fieldrecovery.schemas import (
    INT32_MAX,
    AssemblyResult,
    EffectiveFactView,
    ParsedFactSet,
    RecoveryPatchSet,
    RecoveryRequestSet,
    SourceKind,
    sha256_hex,
)
from fieldrecovery.store import ClaimOutcome, InvocationStore, LeaseKeeper, new_owner_id
from fieldrecovery.tables import ArtifactType
from logfmt import log_event
from settings import FieldRecoverySettings, get_settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _OwnedCall:
    """One provider call made as the key's owner: what fences its writes (``owner_id``,
    ``epoch``) and what its audit and log lines carry."""

    key: str
    request_id: str
    owner_id: str
    epoch: int
    progress: CallProgress
    started: float  #: ``time.monotonic()`` when the call began (the audit's duration)


def _log_call_end(call: _OwnedCall, audit: ProviderAudit, **fields: Any) -> None:
    """The ``provider_call_end`` line of a call that got as far as an audit."""
    log_event(
        log,
        "provider_call_end",
        key=call.key,
        request_id=call.request_id,
        run_id=call.progress.run_id,
        duration_ms=audit.duration_ms,
        **fields,
    )


class RecoveryStatus(StrEnum):
    SUCCEEDED = "SUCCEEDED"  #: a stored PatchSet was assembled and applied once (see needs_review)
    FAILED = "FAILED"  #: failed closed; the view is the parser baseline; error_code says why
    NO_TASKS = "NO_TASKS"  #: nothing UNRESOLVED + RECOVERABLE: parser baseline, no provider call
    SKIPPED = "SKIPPED"  #: recovery disabled or the source may not call it (AGENTBUS): baseline


@dataclass(frozen=True)
class RecoveryRun:
    """The outcome of one pipeline run for one EML."""

    status: RecoveryStatus
    view: EffectiveFactView
    replayed: bool = False
    #: 1 when THIS run called the provider (it owned the invocation and sent a request), else 0.
    provider_calls: int = 0
    assembly: AssemblyResult | None = None
    error_code: str | None = None
    idempotency_key: str | None = None

    @property
    def needs_review(self) -> bool:
        """The validator rejected at least one patch: a person must look.

        The accepted patches are applied; the rejected ones never touch a fact. An answer whose
        every patch was rejected recovers nothing and is the plainest case.
        """
        return self.assembly is not None and bool(self.assembly.rejected)

    def summary(self) -> dict[str, Any]:
        """What the Celery task returns (and Celery logs and stores): no booking data at all."""
        return {
            "status": self.status.value,
            "needs_review": self.needs_review,
            "error_code": self.error_code,
            "idempotency_key": self.idempotency_key,
        }

    def to_json(self) -> dict[str, Any]:
        """The public ``agent-recovery field recover --json`` shape."""
        return {
            "status": self.status.value,
            "needs_review": self.needs_review,
            "replayed": self.replayed,
            "provider_calls": self.provider_calls,
            "effective_view": {
                "facts": [
                    {"path": f.path, "value": f.value, "status": f.status.value, "provenance": f.provenance.value}
                    for f in self.view.facts
                ]
            },
            "rejected": [
                {"task_id": r.task_id, "reason": r.reason} for r in (self.assembly.rejected if self.assembly else [])
            ],
            "error_code": self.error_code,
            "idempotency_key": self.idempotency_key,
        }


#: The next pipeline stage ("continue the existing Context"); receives the finished run.
NextStage = Callable[[RecoveryRun], None]


class FieldRecoveryOrchestrator:
    def __init__(
        self,
        settings: FieldRecoverySettings,
        *,
        url: str | None = None,
        client_factory: Callable[[FieldRecoverySettings], OpenApiClient] = client_for,
        next_stage: NextStage | None = None,
    ) -> None:
        self.settings = settings
        self.store = InvocationStore(
            url, schema=settings.db_schema, lease_seconds=settings.lease_seconds, retention_days=settings.retention_days
        )
        self._client_factory = client_factory
        self._next_stage = next_stage

    def process(self, raw_eml: bytes, *, source: SourceKind = SourceKind.MANUAL_EML, attempt: int = 1) -> RecoveryRun:
        """Run the pipeline for one EML; the next stage runs only after recovery finished.

        Raises EmlInvalid for a file the parser cannot take and AttemptInvalid for an attempt
        outside 1..INT32_MAX, before anything is written.
        """
        if isinstance(attempt, bool) or not isinstance(attempt, int) or not 1 <= attempt <= INT32_MAX:
            raise AttemptInvalid(f"the attempt must be an integer from 1 to {INT32_MAX}")
        facts = parse_eml(raw_eml, channel=source, limits=self.settings.eml)
        run = self._recover(facts, source, attempt)
        if self._next_stage is not None:
            self._next_stage(run)
        return run

    def _recover(self, facts: ParsedFactSet, source: SourceKind, attempt: int) -> RecoveryRun:
        """The PARSED_FACT_SET artifact is written in every case: alone when there is nothing to
        call, else by the claim (with RECOVERY_REQUEST, each only if not stored yet), before any
        provider call."""
        parsed = ArtifactDraft(
            ArtifactType.PARSED_FACT_SET,
            facts.source,
            facts.model_dump(mode="json"),
            content_hash=facts.observation_hash,  # sha256 of the same canonical JSON
        )
        if source != SourceKind.MANUAL_EML or not self.settings.enabled:
            reason = "source_not_allowed" if source != SourceKind.MANUAL_EML else "disabled"
            self._put_artifacts(parsed)
            log_event(log, "recovery_skipped", source=source.value, reason=reason)
            return RecoveryRun(RecoveryStatus.SKIPPED, project(facts))
        request = build_request(facts, profile_version=self.settings.profile_version, attempt=attempt)
        if request is None:
            self._put_artifacts(parsed)
            log_event(log, "recovery_not_needed", source=source.value)
            return RecoveryRun(RecoveryStatus.NO_TASKS, project(facts))
        return self._invoke(facts, request, parsed)

    def _put_artifacts(self, *drafts: ArtifactDraft) -> None:
        with self.store.connection() as conn:
            put_artifacts(conn, drafts, retention=self.store.retention)

    # --- the invocation --------------------------------------------------------------------

    def _invoke(self, facts: ParsedFactSet, request: RecoveryRequestSet, parsed: ArtifactDraft) -> RecoveryRun:
        deadline = Deadline(self.settings.max_wait)
        key = request.idempotency_key
        message = render_message(request)
        meta = InvocationMeta(
            idempotency_key=key,
            request_id=request.request_id,
            attempt=request.attempt,
            source_message_id=facts.source.message_id,
            source_revision=facts.source.revision,
            observation_hash=request.observation_hash,
            profile_version=request.profile_version,
            request_hash=request_hash(message),
        )
        artifacts = [
            parsed,
            ArtifactDraft(ArtifactType.RECOVERY_REQUEST, facts.source, request.model_dump(mode="json"), key),
        ]
        owner_id = new_owner_id()
        while True:
            claim_sent = time.monotonic()  # the lease runs from the claim: count from before it was sent
            claim = self.store.claim(meta, owner_id, stale_takeover=self.settings.stale_takeover, artifacts=artifacts)
            artifacts = []  # written (or already there) with the first claim
            if claim.owned:
                break
            if claim.outcome in (ClaimOutcome.SUCCEEDED, ClaimOutcome.FAILED):
                assert claim.record is not None
                log_event(log, "replay", key=key, request_id=request.request_id, status=claim.outcome.value)
                if claim.outcome == ClaimOutcome.FAILED:
                    return self._failed(facts, key, claim.record.error_code or "failed", replayed=True)
                if claim.record.assembly_result is not None:
                    return self._replay_assembly(facts, key, claim.record.assembly_result)
                # Succeeded but not assembled yet (its owner died between the two writes, or is
                # between them now): assemble from the stored PatchSet, put-if-absent.
                assert claim.record.patch_set is not None
                patch_set = RecoveryPatchSet.model_validate(claim.record.patch_set)
                return self._apply(facts, request, patch_set, replayed=True, provider_calls=0)
            # BUSY: another owner is calling; wait for its result within OUR deadline.
            left = deadline.remaining()
            if left <= 0:
                log_event(log, "claim_wait_timeout", key=key, request_id=request.request_id)
                return self._failed(facts, key, "invocation_in_progress")
            time.sleep(min(self.settings.poll_interval, left))
        assert claim.epoch is not None
        crash_point("field.after_claim")  # owner recorded, provider not called yet
        dead_run = claim.record.provider_run_id if claim.outcome == ClaimOutcome.TAKEN_OVER and claim.record else None
        return self._call_as_owner(
            facts,
            request,
            message,
            owner_id=owner_id,
            epoch=claim.epoch,
            deadline=deadline,
            claim_sent=claim_sent,
            dead_run=dead_run,
        )

    def _call_as_owner(
        self,
        facts: ParsedFactSet,
        request: RecoveryRequestSet,
        message: str,
        *,
        owner_id: str,
        epoch: int,
        deadline: Deadline,
        claim_sent: float,
        dead_run: str | None = None,
    ) -> RecoveryRun:
        """Call the provider as the key's owner, then record how the call ended: the answer
        stored and applied (``_store_answer``), or the invocation failed closed
        (``_call_failed``, ``_call_broke``). ``dead_run``: the platform run of the owner this
        one took over, cancelled before calling again (it may still be running and paid for)."""
        key = request.idempotency_key
        call = _OwnedCall(
            key=key,
            request_id=request.request_id,
            owner_id=owner_id,
            epoch=epoch,
            progress=CallProgress(on_run=self._run_recorder(key, owner_id, epoch)),
            started=time.monotonic(),
        )
        answer: ProviderAnswer | None = None
        log_event(log, "provider_call_start", key=key, request_id=request.request_id, epoch=epoch)
        try:
            client = self._client_for(message, call, dead_run)
            with LeaseKeeper(self.store, key, owner_id, epoch, claimed_at=claim_sent) as lease:
                # A lost lease (a newer epoch took the key) stops the call: the answer could
                # never be stored, so calling on would only spend the provider's time.
                answer = client.recover(
                    message,
                    idempotency_key=key,
                    subject_id=sha256_hex(facts.source.message_id),
                    deadline=deadline,
                    progress=call.progress,
                    stop=lease.lost,
                )
                patch_set = parse_patch_set(answer.content, max_chars=self.settings.max_response_chars)
        except FieldRecoveryError as exc:
            return self._call_failed(facts, call, exc, answer)
        except Exception as exc:
            return self._call_broke(facts, call, type(exc).__name__)
        except BaseException:
            # An interrupt: fail closed in the record too, then let it propagate.
            log_event(log, "provider_call_end", key=key, run_id=call.progress.run_id, error_code="interrupted")
            self._finish_failed(key, owner_id, epoch, "interrupted", self._audit(call.progress, None, call.started))
            raise
        return self._store_answer(facts, request, call, answer, patch_set)

    def _client_for(self, message: str, call: _OwnedCall, dead_run: str | None) -> OpenApiClient:
        """Step 1: the provider's client, after what comes before any call: a message over the
        limit is refused (``RequestTooLarge``), the dead owner's run is cancelled."""
        if len(message) > self.settings.max_message_chars:
            raise RequestTooLarge()
        client = self._client_factory(self.settings)
        if dead_run is not None:
            log_event(log, "takeover_cancel", key=call.key, run_id=dead_run, ok=client.cancel(dead_run))
        return client

    def _call_failed(
        self, facts: ParsedFactSet, call: _OwnedCall, exc: FieldRecoveryError, answer: ProviderAnswer | None
    ) -> RecoveryRun:
        """Step 2, a classified failure (the provider, the deadline, the answer's strict parse):
        the invocation FAILED with its code; ``invocation_lost`` when a newer owner fenced us out."""
        audit = self._audit(call.progress, answer, call.started)
        _log_call_end(call, audit, error_code=exc.code, cancel_sent=call.progress.cancel_sent)
        try:
            landed = self.store.finish_failure(
                call.key, call.owner_id, call.epoch, code=exc.code, summary=str(exc), audit=audit
            )
        except FieldRecoveryError as store_exc:  # e.g. a run-status value the database refused
            log_event(log, "finish_failure_retry", key=call.key, error_code=store_exc.code)
            landed = self._finish_failed(
                call.key, call.owner_id, call.epoch, exc.code, self._audit(call.progress, None, call.started)
            )
        return self._failed(
            facts, call.key, exc.code if landed else "invocation_lost", provider_calls=call.progress.called
        )

    def _call_broke(self, facts: ParsedFactSet, call: _OwnedCall, error: str) -> RecoveryRun:
        """Step 2, a bug: fail closed in the record too and return a FAILED result (never a
        traceback)."""
        log_event(
            log,
            "provider_call_end",
            key=call.key,
            run_id=call.progress.run_id,
            error_code="internal_error",
            error=error,
        )
        self._finish_failed(
            call.key, call.owner_id, call.epoch, "internal_error", self._audit(call.progress, None, call.started)
        )
        return self._failed(facts, call.key, "internal_error", provider_calls=call.progress.called)

    def _store_answer(
        self,
        facts: ParsedFactSet,
        request: RecoveryRequestSet,
        call: _OwnedCall,
        answer: ProviderAnswer,
        patch_set: RecoveryPatchSet,
    ) -> RecoveryRun:
        """Step 2, an answer: stored under the owner's epoch (SUCCEEDED), then applied once."""
        audit = self._audit(call.progress, answer, call.started)
        _log_call_end(call, audit, error_code=None, profile_version=answer.resolved_profile_version)
        try:
            landed = self.store.finish_success(
                call.key, call.owner_id, call.epoch, patch_set.model_dump(mode="json"), audit
            )
        except FieldRecoveryError as exc:
            # The answer could not be stored (a value the database refused, the database gone):
            # the key must not stay IN_PROGRESS; FAILED with the minimal audit, if the store lets us.
            log_event(log, "provider_answer_not_stored", key=call.key, run_id=call.progress.run_id, error_code=exc.code)
            self._finish_failed(
                call.key, call.owner_id, call.epoch, exc.code, self._audit(call.progress, None, call.started)
            )
            return self._failed(facts, call.key, exc.code, provider_calls=call.progress.called)
        if not landed:
            # NOTE: a newer owner fenced us out; our answer is never used (it may differ).
            return self._failed(facts, call.key, "invocation_lost", provider_calls=call.progress.called)
        return self._apply(facts, request, patch_set, replayed=False, provider_calls=call.progress.called)

    def _finish_failed(self, key: str, owner_id: str, epoch: int, code: str, audit: ProviderAudit) -> bool:
        """IN_PROGRESS -> FAILED on a path that is already failing: never raises (False if not written)."""
        try:
            return self.store.finish_failure(key, owner_id, epoch, code=code, summary=f"failed: {code}", audit=audit)
        except Exception as exc:  # the database is gone too: the lease expires; operators can release
            log_event(log, "finish_failure_failed", key=key, error_code=code, error=type(exc).__name__)
            return False

    def _run_recorder(self, key: str, owner_id: str, epoch: int) -> Callable[[str, str], None]:
        """Records the run id on the invocation as soon as the stream names it (best effort: a
        store error is logged, and the call goes on)."""

        def record(session_id: str, run_id: str) -> None:
            try:
                self.store.note_run(key, owner_id, epoch, session_id=session_id, run_id=run_id)
            except FieldRecoveryError as exc:
                log_event(log, "run_not_recorded", key=key, run_id=run_id, error_code=exc.code)
                return
            crash_point("field.after_run_recorded")

        return record

    @staticmethod
    def _audit(progress: CallProgress, answer: ProviderAnswer | None, started: float) -> ProviderAudit:
        duration_ms = int((time.monotonic() - started) * 1000)
        if answer is None:
            return ProviderAudit(session_id=progress.session_id, run_id=progress.run_id, duration_ms=duration_ms)
        return ProviderAudit(
            session_id=answer.session_id,
            run_id=answer.run_id,
            resolved_profile_id=answer.resolved_profile_id,
            resolved_profile_version=answer.resolved_profile_version,
            model=answer.model,
            prompt_tokens=answer.prompt_tokens,
            completion_tokens=answer.completion_tokens,
            total_tokens=answer.total_tokens,
            duration_ms=duration_ms,
            # NOTE: surrogatepass: the client refuses a lone surrogate, but the audit of a failing
            # path must never raise while it records why it failed.
            response_hash=hashlib.sha256(answer.content.encode("utf-8", "surrogatepass")).hexdigest(),
        )

    # --- outcomes --------------------------------------------------------------------------

    def _apply(
        self,
        facts: ParsedFactSet,
        request: RecoveryRequestSet,
        patch_set: RecoveryPatchSet,
        *,
        replayed: bool,
        provider_calls: int,
    ) -> RecoveryRun:
        """Assemble and apply once: the first assembly is stored with its artifacts, atomically."""
        assembly = assemble(request, patch_set)
        view = project(facts, assembly)
        key = request.idempotency_key
        try:
            written, stored = self.store.put_assembly(
                key,
                assembly.model_dump(mode="json"),
                artifacts=[
                    ArtifactDraft(ArtifactType.RECOVERY_ASSEMBLY, facts.source, assembly.model_dump(mode="json"), key),
                    ArtifactDraft(ArtifactType.EFFECTIVE_FACT_VIEW, facts.source, view.model_dump(mode="json"), key),
                ],
            )
        except FieldRecoveryError as exc:
            # NOTE: a purge may delete the row between a replay's read and this write
            # (``not_succeeded``); nothing was applied: fail closed with the parser baseline.
            log_event(log, "assembly_not_applied", key=key, error_code=exc.code)
            return self._failed(facts, key, exc.code, replayed=replayed, provider_calls=provider_calls)
        if not written:  # replay: the stored assembly is the one that counts
            assembly = AssemblyResult.model_validate(stored)
            view = project(facts, assembly)
        return self._succeeded(
            key,
            assembly,
            view,
            event="assembly_applied" if written else "assembly_replayed",
            replayed=replayed,
            provider_calls=provider_calls,
        )

    @staticmethod
    def _replay_assembly(facts: ParsedFactSet, key: str, stored: dict[str, Any]) -> RecoveryRun:
        """A replay of an applied invocation: the stored assembly is the result, as it was applied.

        Nothing is validated, assembled or written again, and that is safe: the assembly was
        made here by the local validator and resolver from a PatchSet that passed the strict
        parse before it was stored, it is written once (put-if-absent, never changed after),
        and it is deterministic in (request, PatchSet), both fixed by the idempotency key. A
        re-assembly would be thrown away for the stored one anyway (apply-once).
        """
        assembly = AssemblyResult.model_validate(stored)
        return FieldRecoveryOrchestrator._succeeded(
            key, assembly, project(facts, assembly), event="assembly_replayed", replayed=True, provider_calls=0
        )

    @staticmethod
    def _succeeded(
        key: str, assembly: AssemblyResult, view: EffectiveFactView, *, event: str, replayed: bool, provider_calls: int
    ) -> RecoveryRun:
        """The SUCCEEDED result of an assembly applied now (or replayed), with its log line."""
        log_event(
            log,
            event,
            key=key,
            accepted=len(assembly.accepted),
            rejected=len(assembly.rejected),
            unresolved=len(assembly.unresolved),
            needs_review=bool(assembly.rejected),
        )
        return RecoveryRun(
            RecoveryStatus.SUCCEEDED,
            view,
            replayed=replayed,
            provider_calls=provider_calls,
            assembly=assembly,
            idempotency_key=key,
        )

    @staticmethod
    def _failed(
        facts: ParsedFactSet, key: str, code: str, *, replayed: bool = False, provider_calls: int = 0
    ) -> RecoveryRun:
        return RecoveryRun(
            RecoveryStatus.FAILED,
            project(facts),
            replayed=replayed,
            provider_calls=provider_calls,
            error_code=code,
            idempotency_key=key,
        )


def recover_eml(
    raw_eml: bytes,
    *,
    source: SourceKind = SourceKind.MANUAL_EML,
    attempt: int = 1,
    settings: FieldRecoverySettings | None = None,
    url: str | None = None,
) -> RecoveryRun:
    """One EML through the pipeline with the process settings (CLI and Celery task entry)."""
    field_settings = settings or get_settings().booking_field_recovery
    return FieldRecoveryOrchestrator(field_settings, url=url).process(raw_eml, source=source, attempt=attempt)
