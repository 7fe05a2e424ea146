"""RecoveryRequestBuilder: the minimal RecoveryRequestSet for exact UNRESOLVED + RECOVERABLE facts.

Minimal means (docs/field-recovery.md): per task only its own evidence lines, candidates and value
schema; never the mail body, an attachment, a URL or the parser's full object. The request id
and the idempotency key are derived from the source and the observation, so every caller that
parses the same EML builds the same request (a concurrent caller or a replay compares equal).
"""

from __future__ import annotations

import re

from fieldrecovery.schemas import (
    SCHEMA_VERSION,
    Evidence,
    FactStatus,
    ParsedFactSet,
    Recoverability,
    RecoveryRequestSet,
    RecoveryTask,
    canonical_json,
    sha256_hex,
)

#: The only text added to the JSON: a stable protocol hint, no business rules.
PROTOCOL_HINT = (
    "Field recovery protocol v1. Answer with exactly one JSON object: a RecoveryPatchSet for the "
    "RecoveryRequestSet below. No Markdown, no text before or after the object."
)

_URL = re.compile(r"(?i)\b(?:[a-z][a-z0-9+.-]*://|www\.)\S+")


def idempotency_key(message_id: str, revision: int, observation_hash: str, profile_version: str, attempt: int) -> str:
    """Stable hash of source message id, revision, observation hash, profile version and attempt."""
    return sha256_hex("\n".join([message_id, str(revision), observation_hash, profile_version, str(attempt)]))


def task_id_of(field: str) -> str:
    return f"task-{field}"


def build_request(facts: ParsedFactSet, *, profile_version: str, attempt: int = 1) -> RecoveryRequestSet | None:
    """The request for ``facts``, or None when no fact is exactly UNRESOLVED + RECOVERABLE."""
    recoverable = {
        f.field
        for f in facts.facts
        if f.status == FactStatus.UNRESOLVED and f.recoverability == Recoverability.RECOVERABLE and f.candidates
    }
    tasks = [
        RecoveryTask(
            task_id=task_id_of(f.field),
            field=f.field,
            path=f.path,
            value_schema=f.value_schema,
            evidence=[Evidence(ref=e.ref, text=_scrub(e.text)) for e in f.evidence],
            candidates=list(f.candidates),
            depends_on=[task_id_of(d) for d in f.depends_on if d in recoverable],
        )
        for f in facts.facts
        if f.field in recoverable
    ]
    if not tasks:
        return None
    observation_hash = facts.observation_hash
    key = idempotency_key(facts.source.message_id, facts.source.revision, observation_hash, profile_version, attempt)
    return RecoveryRequestSet(
        schema_version=SCHEMA_VERSION,
        request_id=f"frq_{key[:32]}",
        attempt=attempt,
        idempotency_key=key,
        source=facts.source,
        observation_hash=observation_hash,
        profile_version=profile_version,
        tasks=tasks,
    )


def render_message(request: RecoveryRequestSet) -> str:
    """The message content sent to the parsing agent: protocol hint + the request JSON."""
    return PROTOCOL_HINT + "\n\n" + canonical_json(request.model_dump(mode="json"))


def request_hash(message: str) -> str:
    return sha256_hex(message)


def parse_message(content: str) -> RecoveryRequestSet:
    """The request inside a rendered message (used by the stand-in, as the real agent would)."""
    return RecoveryRequestSet.model_validate_json(content[content.index("{") :])


def _scrub(text: str) -> str:
    return _URL.sub("[link removed]", text)
