"""Alembic environment: URL from settings (or the caller), every model module imported."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Table, create_engine, pool
from sqlalchemy.schema import SchemaItem

import models  # noqa: F401  (imports every model module)
from models.base import Base
from settings import get_settings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return str(config.attributes.get("url") or get_settings().DATABASE_URL)


def _include_object(
    obj: SchemaItem, name: str | None, type_: str, reflected: bool, compare_to: SchemaItem | None
) -> bool:
    # Field-recovery tables live in their own schema with their own MetaData and are compared
    # by their own test (tests/integration/test_field_migration.py); skip them here.
    field_schema = get_settings().booking_field_recovery.db_schema
    return not (isinstance(obj, Table) and reflected and compare_to is None and obj.schema == field_schema)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = _url()
    connectable = create_engine(url, poolclass=pool.NullPool)
    with connectable.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            include_schemas=True,
            include_object=_include_object,
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
