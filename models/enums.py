"""Status enums, one StrEnum each, with the meaning of every value (docs/state-machines.md)."""

from __future__ import annotations

from enum import StrEnum


class SessionType(StrEnum):
    NORMAL = "NORMAL"  #: a user's top-level agent session
    SIDE_TASK = "SIDE_TASK"  #: a side task started by the system for a user
    SUBAGENT = "SUBAGENT"  #: a child session created by delegate; recovered only through its execution


class ExecutionMode(StrEnum):
    CLOUD = "CLOUD"  #: tools run on our workers
    LOCAL = "LOCAL"  #: tools run on the user's desktop client, which must be connected


class Phase(StrEnum):
    IDLE = "IDLE"  #: created, nothing running
    RUNNING = "RUNNING"  #: an agent loop owns this session (under a lease)
    RESUMING = "RESUMING"  #: recovery owns this session; shown as RUNNING outside
    WAITING_USER = "WAITING_USER"  #: the loop ended its turn and waits for the user
    #: a tool call waits for a human decision (models.approval); no loop, lease or worker slot
    #: holds the session meanwhile, and the scan never takes it as dead work
    WAITING_APPROVAL = "WAITING_APPROVAL"
    COMPLETED = "COMPLETED"  #: terminal: finished
    FAILED = "FAILED"  #: terminal: failed
    CANCELLED = "CANCELLED"  #: terminal: cancelled by a user or the system


#: Phases in which a session's work is still in flight.
ACTIVE_PHASES = (Phase.RUNNING, Phase.RESUMING)
#: Phases of a parent that must never receive a delivery nor be resumed.
STOPPED_PHASES = (Phase.COMPLETED, Phase.FAILED, Phase.CANCELLED)


class Role(StrEnum):
    SYSTEM = "SYSTEM"
    USER = "USER"
    ASSISTANT = "ASSISTANT"
    TOOL = "TOOL"


class ExecutionStatus(StrEnum):
    RUNNING = "RUNNING"  #: the normal path runs this child
    RECOVERING = "RECOVERING"  #: a recovery task owns this execution
    COMPLETED = "COMPLETED"  #: terminal: the child produced its final answer
    FAILED = "FAILED"  #: terminal: the child failed or timed out
    CANCELLED = "CANCELLED"  #: terminal: the child was cancelled


ACTIVE_EXECUTION = (ExecutionStatus.RUNNING, ExecutionStatus.RECOVERING)
TERMINAL_EXECUTION = (ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.CANCELLED)


class DeliveryStatus(StrEnum):
    PENDING = "PENDING"  #: the result has not reached the parent yet
    DELIVERED = "DELIVERED"  #: assistant tool_call + TOOL committed in the parent's history
    SUPPRESSED = "SUPPRESSED"  #: the parent was cancelled/terminal; nothing is written to it
    LEGACY = "LEGACY"  #: ended before the upgrade; never scanned, never delivered


class InvocationType(StrEnum):
    DELEGATE = "DELEGATE"  #: first delegation; created the child session
    FOLLOWUP = "FOLLOWUP"  #: delegate_followup to an existing child session


class FailureCode(StrEnum):
    """Why a session ended FAILED or CANCELLED (``agent_session.failure_code``; docs/providers.md,
    "Failure reasons")."""

    AUTH = "auth"  #: the provider refused our key (HTTP 401, 403)
    MODEL_NOT_FOUND = "model_not_found"  #: the provider has no such model (HTTP 404)
    CONTEXT_TOO_LONG = "context_too_long"  #: the request is longer than the model takes (413, context_length_exceeded)
    PROVIDER_REJECTED = "provider_rejected"  #: the provider refused this request (another 4xx)
    PROVIDER_ERROR = "provider_error"  #: the provider failed on this request every time (a 409, 500, 501, 505)
    BAD_RESPONSE = "bad_response"  #: the answer was not a chat completion
    READ_TIMEOUT = "read_timeout"  #: no answer within MODEL_READ_TIMEOUT_SECONDS, past its retries
    MODEL_UNAVAILABLE = "model_unavailable"  #: a provider outage lasted MODEL_OUTAGE_MAX_SECONDS
    REFUSAL = "refusal"  #: the model refused (its refusal text is kept in the history)
    CONTENT_FILTER = "content_filter"  #: the provider's filter withheld the answer
    TRUNCATED = "truncated"  #: the answer was cut off at its token limit (finish_reason length)
    NO_TOOL_CALLS = "no_tool_calls"  #: finish_reason tool_calls, but the reply held no call
    MAX_ROUNDS = "max_rounds"  #: the agent's max_rounds passed without a final answer
    DEADLINE = "deadline"  #: a child's absolute deadline passed
    TOOL_CRASH = "tool_crash"  #: running a tool failed outside the tool (its own errors are TOOL results)
    TOOL_ARGUMENTS = "tool_arguments"  #: the model sent arguments a tool could not take, past its max_retries
    INVALID_HISTORY = "invalid_history"  #: the history can never be shown to a model (a bad compaction boundary)
    CANCELLED_BY = "cancelled_by"  #: an operator or a user cancelled it (the message names who)
    PARENT_STOPPED = "parent_stopped"  #: a child whose parent was stopped: its result is suppressed
    BUDGET_EXHAUSTED = "budget_exhausted"  #: its tree's token budget refused a model call's reservation
    RELEASE_UNAVAILABLE = "release_unavailable"  #: no worker of its release took it within RELEASE_WAIT_SECONDS
    INTERNAL_ERROR = "internal_error"  #: anything else: the message names the exception's type
