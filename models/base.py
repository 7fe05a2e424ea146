"""The one DeclarativeBase, the id type and UTC time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import BigInteger, DateTime, Integer, MetaData, Numeric, String
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.types import TypeDecorator

_ZERO = timedelta(0)
#: BIGINT identity on PostgreSQL; INTEGER on SQLite so that it is the rowid alias (autoincrement).
BigId = BigInteger().with_variant(Integer(), "sqlite")
#: A USD amount: a model call costs fractions of a cent (models.prices).
USD = Numeric(20, 9)

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def utcnow() -> datetime:
    """The database's time (models.clock): leases and deadlines never use a worker's clock."""
    from models.clock import db_utcnow

    return db_utcnow()


class UTCDateTime(TypeDecorator[datetime]):
    """timestamptz on PostgreSQL; on SQLite (naive storage) values come back as UTC-aware."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given; all timestamps are UTC-aware")
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        # The driver gives the database session's zone (PGTZ, a role's timezone): shown as UTC.
        return value if value.utcoffset() == _ZERO else value.astimezone(UTC)


class StrEnumType(TypeDecorator[StrEnum]):
    """A StrEnum stored as VARCHAR; the allowed values are a CHECK constraint in the table."""

    impl = String(20)
    cache_ok = True

    def __init__(self, enum: type[StrEnum], length: int = 20) -> None:
        super().__init__(length)
        self.enum = enum

    def process_bind_param(self, value: Any, dialect: Any) -> str | None:
        return None if value is None else str(self.enum(value))

    def process_result_value(self, value: Any, dialect: Any) -> StrEnum | None:
        if value is None:
            return None
        # The enum's own value map first: the constructor costs about 1 µs a value, which a
        # page of thousands of rows feels; a value not in the map still raises as before.
        member = self.enum._value2member_map_.get(value)
        return member if member is not None else self.enum(value)  # type: ignore[return-value]


def check_in(column: str, enum: type[StrEnum], nullable: bool = False) -> str:
    """SQL text of a CHECK that ``column`` holds one of the enum's values."""
    values = ", ".join(f"'{v.value}'" for v in enum)
    clause = f"{column} IN ({values})"
    return f"{column} IS NULL OR {clause}" if nullable else clause
