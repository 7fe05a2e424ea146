"""Field-recovery contracts (pydantic, snake_case, unknown fields forbidden).

``RecoveryRequestSet`` is what we send to the SuperAgent parsing agent; ``RecoveryPatchSet`` is
the only answer we accept from it. Provider-facing models are also *strict*: no type coercion,
so ``"0.9"`` is not a confidence and ``1`` is not a value. Facts, views and assembly results are
our own records (stored as JSON in the invocation and artifact tables).

All values are JSON strings in canonical form: dates ``YYYY-MM-DD``, integers ``42``, decimals
``180.00``, enums one of the listed values.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import date
from enum import StrEnum
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Version of both the request and the patch set contract.
SCHEMA_VERSION = "1"


class SourceKind(StrEnum):
    MANUAL_EML = "MANUAL_EML"  #: an operator uploaded an EML; recovery runs synchronously
    AGENTBUS = "AGENTBUS"  #: arrived through the AgentBus callback; never calls the provider


class FactStatus(StrEnum):
    RESOLVED = "RESOLVED"  #: the fact has a settled value
    UNRESOLVED = "UNRESOLVED"  #: no settled value


class Recoverability(StrEnum):
    RECOVERABLE = "RECOVERABLE"  #: evidence and candidates exist; the parsing agent may settle it
    NOT_RECOVERABLE = "NOT_RECOVERABLE"  #: nothing to recover from (e.g. the label is missing)


class Provenance(StrEnum):
    PARSER = "PARSER"  #: the deterministic parser's verdict
    RECOVERY = "RECOVERY"  #: an accepted, validated recovery patch


class ValueType(StrEnum):
    STRING = "string"
    DATE = "date"
    INTEGER = "integer"
    DECIMAL = "decimal"
    ENUM = "enum"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# --- request ----------------------------------------------------------------------------------


class ValueSchema(_Model):
    type: ValueType
    #: Allowed values of an ``enum``; absent for every other type.
    values: list[str] | None = None

    @model_validator(mode="after")
    def _values_only_for_enum(self) -> ValueSchema:
        if (self.type == ValueType.ENUM) != bool(self.values):
            raise ValueError("values is required for enum and forbidden otherwise")
        return self


class Evidence(_Model):
    ref: str
    text: str


class Candidate(_Model):
    ref: str
    value: str


class SourceRef(_Model):
    message_id: str
    revision: int
    channel: SourceKind


class RecoveryTask(_Model):
    task_id: str
    field: str
    path: str
    status: Literal["UNRESOLVED"] = "UNRESOLVED"
    recoverability: Literal["RECOVERABLE"] = "RECOVERABLE"
    value_schema: ValueSchema
    evidence: list[Evidence]
    candidates: list[Candidate]
    depends_on: list[str] = Field(default_factory=list)


class RecoveryRequestSet(_Model):
    schema_version: str = SCHEMA_VERSION
    request_id: str
    attempt: int = Field(ge=1)
    idempotency_key: str
    source: SourceRef
    observation_hash: str
    profile_version: str
    tasks: list[RecoveryTask]


# --- answer (provider-facing: strict) ---------------------------------------------------------


class RecoveryPatch(_Strict):
    task_id: str
    field: str
    path: str
    value: str
    evidence_refs: list[str]
    candidate_ref: str | None = None
    confidence: float = Field(ge=0.0, le=1.0)


class UnresolvedTask(_Strict):
    task_id: str
    reason: str = Field(max_length=200)


class RecoveryPatchSet(_Strict):
    schema_version: str
    request_id: str
    attempt: int
    idempotency_key: str
    patches: list[RecoveryPatch]
    unresolved: list[UnresolvedTask] = Field(default_factory=list)


# --- facts, assembly, effective view ----------------------------------------------------------


class ParsedFact(_Model):
    field: str
    path: str
    status: FactStatus
    value: str | None = None
    #: Set for UNRESOLVED facts only.
    recoverability: Recoverability | None = None
    value_schema: ValueSchema
    evidence: list[Evidence] = Field(default_factory=list)
    candidates: list[Candidate] = Field(default_factory=list)
    #: Fields (not task ids) whose recovered value this one needs.
    depends_on: list[str] = Field(default_factory=list)


class ParsedFactSet(_Model):
    schema_version: str = SCHEMA_VERSION
    source: SourceRef
    facts: list[ParsedFact]

    @cached_property
    def observation_hash(self) -> str:
        """Stable hash of what the parser observed (part of the idempotency key).

        Computed once per instance (the model is frozen): the request, the view and the
        PARSED_FACT_SET artifact's content hash all use it."""
        return sha256_hex(canonical_json(self.model_dump(mode="json")))


class Rejection(_Model):
    task_id: str
    #: A stable reason code, e.g. ``candidate_value_mismatch`` or ``dependency_unresolved``.
    reason: str


class AssemblyResult(_Model):
    schema_version: str = SCHEMA_VERSION
    request_id: str
    idempotency_key: str
    accepted: list[RecoveryPatch]
    rejected: list[Rejection]
    #: Tasks the parsing agent itself declared unresolved.
    unresolved: list[UnresolvedTask]


class EffectiveFact(_Model):
    path: str
    field: str
    value: str | None
    status: FactStatus
    provenance: Provenance
    task_id: str | None = None
    evidence_refs: list[str] = Field(default_factory=list)


class EffectiveFactView(_Model):
    schema_version: str = SCHEMA_VERSION
    source: SourceRef
    observation_hash: str
    #: The invocation the view was assembled from; None for a parser-only baseline.
    idempotency_key: str | None = None
    facts: list[EffectiveFact]

    def fact(self, field: str) -> EffectiveFact:
        for f in self.facts:
            if f.field == field:
                return f
        raise KeyError(field)


# --- helpers ----------------------------------------------------------------------------------


def canonical_json(obj: Any) -> str:
    """Deterministic JSON text (sorted keys, no spaces) used for hashes and stored payloads."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


#: The largest value of a PostgreSQL ``integer`` column (revisions, attempts, token counts).
INT32_MAX = 2**31 - 1


def storable_text(value: str) -> bool:
    """True when ``value`` can be hashed and stored: UTF-8 encodable (no lone surrogate), no NUL.

    Every string that comes from outside (an EML header, a provider's answer or run status) is
    checked with this before it reaches ``sha256_hex`` or a PostgreSQL text column: psycopg2
    refuses a NUL and ``str.encode`` refuses a lone surrogate, each with a traceback.
    """
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_INTEGER = re.compile(r"^(0|[1-9][0-9]{0,8})$")
_DECIMAL = re.compile(r"^(0|[1-9][0-9]{0,11})(\.[0-9]{1,4})?$")
_ISO_DATE = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")


def value_matches(schema: ValueSchema, value: str) -> bool:
    """True when ``value`` is a canonical value of ``schema``."""
    if schema.type == ValueType.STRING:
        return 0 < len(value.strip()) == len(value) <= 256
    if schema.type == ValueType.INTEGER:
        return _INTEGER.match(value) is not None
    if schema.type == ValueType.DECIMAL:
        return _DECIMAL.match(value) is not None
    if schema.type == ValueType.DATE:
        if _ISO_DATE.match(value) is None:
            return False
        try:
            date.fromisoformat(value)
        except ValueError:
            return False
        return True
    return value in (schema.values or [])
