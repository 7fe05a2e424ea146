"""Tool calls get our own ids: the provider's are not keys.

Providers number calls per reply (``call_0`` in every reply, ``functions.refund:0``), repeat an
id inside one reply, or send ids far longer than any column (a signature carried in the id).
So every call of a reply gets a LOCAL id when the reply is first committed (its journal entry,
or the pending round of a delegating reply), before any of its tools runs:

- the local id (``tc_`` + 32 hex digits, random) is unique in the installation and stable
  across recoveries (a recovered loop reads it back from what was committed). Every row and
  key uses it: journal entries and calls, the parent's pending round and its inline results,
  ``subagent_execution.parent_tool_call_id``, TOOL messages, and ``ToolContext.idempotency_key``
  (``sha256("<installation id>:<local id>")``, models.installation);
- the provider's id is kept beside it (``provider_id`` in the stored call), any length, any
  characters: the view sent to the model carries the model's own ids (harness.history);
- a call whose provider id appeared in an earlier round is a new call;
- a provider id repeated inside ONE reply is a true duplicate: the later call is not run, and
  its TOOL result says so (the parent's and the child's loops alike).

Calls stored before local ids existed have no ``provider_id``: their id is the provider's, and
their key the one they had (``sha256("<session id>:<id>")``): a recovered legacy call that is
safe to repeat runs again with the key its first run saw.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from harness import history
from harness.model import ModelReply, ToolCall
from harness.tools import ToolContext
from logfmt import log_event
from models import installation_id, transaction
from settings import get_settings

log = logging.getLogger(__name__)

#: Prefix of a local call id.
LOCAL_PREFIX = "tc_"
#: Key of the provider's id in a stored call (OpenAI format plus this one key); the view sent
#: to the model puts it back in ``id`` (harness.history.to_openai).
PROVIDER_ID = history.PROVIDER_ID
#: Longest part of a provider's id quoted in a TOOL error.
QUOTED_ID_CHARS = 80


@dataclass(frozen=True)
class LocalCall(ToolCall):
    """A call under its local id (``id``), with the id the provider gave it."""

    provider_id: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {**super().to_openai(), PROVIDER_ID: self.provider_id}


def new_call_id() -> str:
    """A fresh local call id: printable, 35 characters, unique in the installation."""
    return f"{LOCAL_PREFIX}{uuid.uuid4().hex}"


def duplicate_result(provider_id: str) -> str:
    """The TOOL result of a call whose provider id appeared earlier in the same reply."""
    return (
        f"error: the model repeated tool_call id {provider_id[:QUOTED_ID_CHARS]!r} in one reply; this call was not run"
    )


def localize(reply: ModelReply, *, session_id: int | None = None) -> tuple[ModelReply, dict[str, str]]:
    """The reply with a local id on every call (a call that has one keeps it), and the TOOL
    errors of the true duplicates (local id -> error): a provider id seen earlier in the same
    reply. Pure: the ids are stable once the caller commits the reply."""
    seen: set[str] = set()
    refused: dict[str, str] = {}
    calls: list[ToolCall] = []
    for call in reply.tool_calls:
        if isinstance(call, LocalCall):
            calls.append(call)
            continue
        local = LocalCall(new_call_id(), call.name, call.arguments, call.extra, provider_id=call.id)
        if call.id in seen:
            refused[local.id] = duplicate_result(call.id)
            log_event(log, "duplicate_tool_call_id", logging.WARNING, session_id=session_id, tool=call.name)
        seen.add(call.id)
        calls.append(local)
    return replace(reply, tool_calls=tuple(calls)), refused


def call_of(stored: dict[str, Any]) -> ToolCall:
    """A stored call (OpenAI format) as the loops handle it: a LocalCall when it has a
    provider id, else a legacy call under the provider's id. The provider's own fields of the
    call (``extra``) are kept either way."""
    call = ToolCall.from_openai({k: v for k, v in stored.items() if k != PROVIDER_ID})
    if PROVIDER_ID in stored:
        return LocalCall(call.id, call.name, call.arguments, call.extra, provider_id=str(stored[PROVIDER_ID]))
    return call


_namespaces: dict[str, str] = {}


def namespace() -> str:
    """The installation id of the configured database, read once per process and database."""
    url = get_settings().DATABASE_URL
    found = _namespaces.get(url)
    if found is None:
        with transaction() as s:
            found = _namespaces[url] = installation_id(s)
    return found


def context_for(
    session_id: int,
    call: ToolCall,
    deadline: datetime | None,
    cancelled: Callable[[], bool],
    kind: str,
) -> ToolContext:
    """The ToolContext of a call: a local call's key is in the installation's namespace; a
    legacy call keeps the key it had."""
    space = namespace() if isinstance(call, LocalCall) else None
    return ToolContext(session_id, call.id, deadline, cancelled, kind, namespace=space)
