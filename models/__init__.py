"""Typed SQLAlchemy models, enums, legal transitions and the transaction helper."""

from __future__ import annotations

from models.approval import ApprovalRequest, ApprovalStatus
from models.base import Base, utcnow
from models.budget import TreeBudget
from models.db import dialect_name, dispose_engines, get_engine, transaction
from models.enums import (
    ACTIVE_EXECUTION,
    ACTIVE_PHASES,
    STOPPED_PHASES,
    TERMINAL_EXECUTION,
    DeliveryStatus,
    ExecutionMode,
    ExecutionStatus,
    FailureCode,
    InvocationType,
    Phase,
    Role,
    SessionType,
)
from models.errors import IllegalTransition, LeaseLost, ModelError
from models.execution import SubagentExecution
from models.installation import Installation, installation_id
from models.journal import CallStatus, JournalStatus, RoundJournal, RoundJournalCall
from models.message import Message
from models.operator_action import OperatorAction
from models.presence import WorkerPresence
from models.release import AgentRelease, ReleaseMove
from models.round import PendingRound
from models.session import AgentSession
from models.usage import ModelCallUsage
from models.worker import RecoveryScan, WorkerBoot

__all__ = [
    "ACTIVE_EXECUTION",
    "ACTIVE_PHASES",
    "STOPPED_PHASES",
    "TERMINAL_EXECUTION",
    "AgentRelease",
    "AgentSession",
    "ApprovalRequest",
    "ApprovalStatus",
    "Base",
    "CallStatus",
    "DeliveryStatus",
    "ExecutionMode",
    "ExecutionStatus",
    "FailureCode",
    "IllegalTransition",
    "Installation",
    "InvocationType",
    "JournalStatus",
    "LeaseLost",
    "Message",
    "ModelCallUsage",
    "ModelError",
    "OperatorAction",
    "PendingRound",
    "Phase",
    "RecoveryScan",
    "ReleaseMove",
    "Role",
    "RoundJournal",
    "RoundJournalCall",
    "SessionType",
    "SubagentExecution",
    "TreeBudget",
    "WorkerBoot",
    "WorkerPresence",
    "dialect_name",
    "dispose_engines",
    "get_engine",
    "installation_id",
    "transaction",
    "utcnow",
]
