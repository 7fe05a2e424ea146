"""installation: one row naming this installation (a random id drawn once, when the schema is
created), the namespace of every tool call's idempotency key.

A tool call's local id is unique in the installation; the key a tool hands to the services it
calls is derived from the installation id and that local id, so a rebuilt database (whose ids
start again) or a second environment (a staging copy of the schema) never hands a service a key
that an earlier call already used.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import CheckConstraint, Integer, String, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, UTCDateTime, utcnow


class Installation(Base):
    __tablename__ = "installation"
    __table_args__ = (CheckConstraint("id = 1", name="one_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    #: Random, drawn once (migration 0011 or the first reader of an emptied table); never changed.
    installation_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


def new_installation_id() -> str:
    return uuid.uuid4().hex


def installation_id(s: Session) -> str:
    """The installation's id; a table emptied by hand gets a new one here (first writer wins:
    the insert does nothing when another transaction's row is there)."""
    found = s.execute(select(Installation.installation_id).where(Installation.id == 1)).scalar_one_or_none()
    if found is not None:
        return str(found)
    from sqlalchemy.dialects import postgresql, sqlite

    dialect = postgresql if s.get_bind().dialect.name == "postgresql" else sqlite
    s.execute(
        dialect.insert(Installation)
        .values(id=1, installation_id=new_installation_id(), created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["id"])
    )
    return str(s.execute(select(Installation.installation_id).where(Installation.id == 1)).scalar_one())
