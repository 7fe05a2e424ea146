"""The design pages keep up with the code: every named crash point has its row in
docs/crash-points.md, every table of the models (the field tables too) has its section in
docs/tables.md, and every column of the core tables is named in it. A new point or table
without its page fails here, not in a reader's head."""

from __future__ import annotations

import re
from pathlib import Path

import crashpoints
import models
from fieldrecovery.tables import FieldBase

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _sections(page: str) -> list[tuple[str, str]]:
    """(heading, body) of each ``## `` section of a page."""
    parts = re.split(r"^## ", page, flags=re.MULTILINE)[1:]
    return [(part.split("\n", 1)[0], part) for part in parts]


def _tables() -> list[object]:
    return [*models.Base.metadata.tables.values(), *FieldBase.metadata.tables.values()]


def test_every_crash_point_has_a_row_in_the_crash_points_page() -> None:
    page = (DOCS / "crash-points.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `([\w.]+)` \|", page, flags=re.MULTILINE))
    missing = [name for name in crashpoints.POINTS if name not in rows]
    assert not missing, f"crash points with no row in docs/crash-points.md: {missing}"


def test_the_crash_points_page_names_no_point_the_code_lacks() -> None:
    page = (DOCS / "crash-points.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `([\w.]+)` \|", page, flags=re.MULTILINE))
    assert rows <= set(crashpoints.POINTS), f"rows for unknown points: {sorted(rows - set(crashpoints.POINTS))}"


def test_every_table_of_the_models_has_a_section_in_the_tables_page() -> None:
    headings = [heading for heading, _ in _sections((DOCS / "tables.md").read_text(encoding="utf-8"))]
    missing = [t.name for t in _tables() if not any(re.search(rf"\b{t.name}\b", h) for h in headings)]  # type: ignore[attr-defined]
    assert not missing, f"tables with no section in docs/tables.md: {missing}"


def test_every_column_of_a_core_table_is_named_in_its_section() -> None:
    sections = _sections((DOCS / "tables.md").read_text(encoding="utf-8"))
    missing: list[str] = []
    for table in models.Base.metadata.tables.values():
        body = "".join(text for heading, text in sections if re.search(rf"\b{table.name}\b", heading))
        named = set(re.findall(r"`(\w+)`", body))
        missing += [f"{table.name}.{c.name}" for c in table.columns if c.name != "id" and c.name not in named]
    assert not missing, f"columns not described in docs/tables.md: {missing}"
