"""Errors of field recovery: one root, leaves named as facts, each with a safe ``code``.

A ``code`` is a short stable token (``deadline_exceeded``, ``output_fenced``) that may be logged,
stored in ``error_code`` and printed. Messages are fixed texts chosen here, never built from the
provider's answer, the request, a header or a key (docs/invariants.md, I8): foreign errors are
translated at the boundary and chained with ``from None`` when their text could carry data.
"""

from __future__ import annotations


class FieldRecoveryError(Exception):
    """Field recovery failed."""

    #: Default safe code of the class; an instance may carry a more specific one.
    default_code = "field_recovery_error"

    def __init__(self, message: str | None = None, *, code: str | None = None) -> None:
        self.code = code or self.default_code
        text = message or (self.__doc__ or "").strip().splitlines()[0]
        super().__init__(f"{text} [{self.code}]")


class DeadlineExceeded(FieldRecoveryError):
    """The total field-recovery deadline (max_wait) passed before a complete answer arrived."""

    default_code = "deadline_exceeded"


class ProviderUnavailable(FieldRecoveryError):
    """The SuperAgent Open API could not be reached or failed (HTTP, SSE or run failure)."""

    default_code = "provider_unavailable"


class ProviderRejected(FieldRecoveryError):
    """The SuperAgent Open API refused the request (authentication, CSRF, trace, bad request)."""

    default_code = "provider_rejected"


class ProviderOutputInvalid(FieldRecoveryError):
    """The provider's final answer is not one strict RecoveryPatchSet JSON object."""

    default_code = "output_invalid"


class RequestTooLarge(FieldRecoveryError):
    """The recovery message exceeds max_message_chars; it was not sent."""

    default_code = "request_too_large"


class InvocationBusy(FieldRecoveryError):
    """Another owner holds the invocation and did not finish within this caller's deadline."""

    default_code = "invocation_in_progress"


class InvocationLost(FieldRecoveryError):
    """This owner's epoch is stale: a newer owner took the invocation over; nothing was written."""

    default_code = "invocation_lost"


class StoreUnavailable(FieldRecoveryError):
    """The field-recovery tables cannot be used (database down or migration 0004 not applied)."""

    default_code = "store_unavailable"


class ValueRejected(FieldRecoveryError):
    """Raised when the database refuses a value (out of range, too long, a NUL); never retried."""

    default_code = "store_value_rejected"


class AttemptInvalid(FieldRecoveryError):
    """Raised when an attempt number is not an integer from 1 to 2**31-1."""

    default_code = "attempt_invalid"


class EmlInvalid(FieldRecoveryError):
    """The file is not a booking-confirmation EML this parser understands."""

    default_code = "eml_invalid"


class EmlTooLarge(EmlInvalid):
    """The EML exceeds a parser limit (input bytes, parts, nesting depth or header bytes)."""

    default_code = "eml_too_large"
