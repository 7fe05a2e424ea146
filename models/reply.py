"""A model reply's rows in one statement: the ASSISTANT message that stores it, its usage row
(models.usage) and, for a budgeted call, its reservation's settlement (models.budget), as one
INSERT with data-modifying WITH entries (PostgreSQL). The usage row then costs the reply no
trip of its own. All of them land, or none: they are one statement of the caller's transaction,
which rolls them back together."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Table, bindparam, insert
from sqlalchemy.orm import Session

from models.budget import settlement_ctes
from models.db import built_once
from models.message import Message
from models.usage import USAGE_COLUMNS, ModelCallUsage

#: The message columns the statement writes, each bound as ``m_<column>`` (the usage row's
#: columns keep their own names, which the settlement's entries read).
MESSAGE_COLUMNS = (
    "session_id",
    "role",
    "content",
    "tool_calls",
    "tool_call_id",
    "source_session_id",
    "provider_fields",
    "incomplete",
    "deleted",
    "created_at",
)


def insert_reply(
    s: Session, *, message: dict[str, Any], usage: dict[str, Any], settlement: dict[str, Any] | None
) -> int:
    """Insert ``message`` (a row of ``harness.history.insert_messages``'s shape, every column of
    ``MESSAGE_COLUMNS``) with the usage row ``usage`` (``models.usage.record_usage``'s columns)
    and, when ``settlement`` is given (``models.budget.settlement_params``), the settlement of
    the call's reservation, in ONE statement of the caller's transaction; returns the message's
    id. PostgreSQL only (SQLite has no data-modifying WITH)."""
    params = {f"m_{name}": message[name] for name in MESSAGE_COLUMNS}
    params.update(usage)
    if settlement is not None:
        params.update(settlement)
    return int(s.execute(_insert_reply_stmt(settlement is not None), params).scalar_one())


@built_once
def _insert_reply_stmt(settles: bool) -> Any:
    messages = cast(Table, Message.__table__)
    usages = cast(Table, ModelCallUsage.__table__)
    usage = (
        insert(usages).values({name: bindparam(name, type_=usages.c[name].type) for name in USAGE_COLUMNS}).cte("usage")
    )
    stmt = insert(messages).values(
        {name: bindparam(f"m_{name}", type_=messages.c[name].type) for name in MESSAGE_COLUMNS}
    )
    ctes = (*settlement_ctes(), usage) if settles else (usage,)
    return stmt.add_cte(*ctes).returning(messages.c.id)
