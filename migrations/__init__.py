"""Alembic environment and versions (docs/tables.md, "Migrations": 0001 pre-upgrade, 0002 the upgrade, 0003+ ours)."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config

ALEMBIC_INI = Path(__file__).resolve().parent.parent / "alembic.ini"


def alembic_config(url: str | None = None) -> Config:
    """An Alembic Config for this project; ``url`` overrides DATABASE_URL."""
    cfg = Config(str(ALEMBIC_INI))
    cfg.set_main_option("script_location", str(Path(__file__).resolve().parent))
    if url:
        cfg.attributes["url"] = url
    return cfg


def upgrade(url: str | None = None, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(url), revision)
