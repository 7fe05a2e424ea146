"""Helpers shared by the field-recovery tests (moved out of the product package; no pytest import)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import text

from models.db import get_engine
from recovery.field.tables import DEFAULT_SCHEMA, FieldBase

#: tests/data, where the sample EML files live.
DATA_DIR = Path(__file__).resolve().parent / "data"


def sample_eml(name: str) -> bytes:
    """A sample EML by name: ``ambiguous``, ``clean`` or ``multipart``."""
    return (DATA_DIR / f"field_booking_{name}.eml").read_bytes()


def clean_field_tables(url: str, schema: str = DEFAULT_SCHEMA) -> None:
    """Empty the field-recovery tables (the core ``db`` fixture does not know this schema)."""
    names = ", ".join(f'"{schema}"."{t.name}"' for t in FieldBase.metadata.sorted_tables)
    with get_engine(url).begin() as conn:
        conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY"))


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes; returns its last value."""
    end = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(interval)
