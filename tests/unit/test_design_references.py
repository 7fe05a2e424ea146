"""The rule that the design lives in the repository: code points into ``docs/`` (or states the
rule itself), never at a file outside the repository, at the old design card or specification by
section, or at an issue number; and every ``docs/`` page it points at exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Product packages and top-level modules: what a person who clones the project reads as code.
PRODUCT = (
    "models",
    "harness",
    "recovery",
    "fieldrecovery",
    "tasks",
    "cli",
    "doubles",
    "demo",
    "devstack",
    "bench",
    "migrations",
    "settings.py",
    "celeryconfig.py",
    "brokerconfig.py",
    "crashpoints.py",
    "logfmt.py",
)

#: What a reference outside the repository looks like, and why it is refused.
FORBIDDEN = (
    (re.compile(r"DESIGN\s*(§|I\d)"), "cites the design card outside the repository: point into docs/"),
    (re.compile(r"\bspec\s*(§|R\d|V\d)"), "cites the specification by section: point into docs/ or state the rule"),
    (re.compile(r"(\.\./)?shared/"), "names a file outside the repository"),
    (re.compile(r"CELERY-NOTES|STYLE\.md|layout-next"), "names a note outside the repository"),
    (re.compile(r"\b[Ii]ssues? #?\d"), "names an issue number: write the rule the issue settled"),
)

_DOCS_POINTER = re.compile(r"docs/([\w./-]+\.md)")


def _sources(names: tuple[str, ...]) -> list[Path]:
    out: list[Path] = []
    for name in names:
        path = ROOT / name
        out += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return out


def violations(path: Path, root: Path = ROOT) -> list[str]:
    """Each line of ``path`` that points outside the repository, or at a docs/ page that is not there."""
    found: list[str] = []
    for lineno, text in enumerate(path.read_text().splitlines(), start=1):
        where = f"{path.relative_to(root)}:{lineno}"
        found += [f"{where}: {why}: {text.strip()}" for pattern, why in FORBIDDEN if pattern.search(text)]
        found += [
            f"{where}: points at docs/{page}, which does not exist"
            for page in _DOCS_POINTER.findall(text)
            if not (ROOT / "docs" / page).is_file()
        ]
    return found


def _test_sources() -> list[Path]:
    """Test modules, without the data they feed the code (which may quote anything) and this rule."""
    return [
        p
        for p in _sources(("tests",))
        if "data" not in p.relative_to(ROOT / "tests").parts and p != Path(__file__).resolve()
    ]


def test_no_product_module_points_outside_the_repository_or_at_an_issue_number() -> None:
    found = [v for path in _sources(PRODUCT) for v in violations(path)]
    assert found == [], "point into docs/ or state the rule (docs/README.md):\n" + "\n".join(found)


def test_no_test_comment_points_outside_the_repository_or_at_an_issue_number() -> None:
    found = [v for path in _test_sources() for v in violations(path)]
    assert found == [], "point into docs/ or state the rule (docs/README.md):\n" + "\n".join(found)


def test_every_page_the_docs_index_lists_exists_and_the_readme_links_the_index() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    pages = re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]+)?\)", index)
    assert len(pages) >= 9
    assert [p for p in pages if not (ROOT / "docs" / p).is_file()] == []
    assert "(docs/README.md)" in (ROOT / "README.md").read_text()


def test_the_rule_sees_the_shapes_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""The scan (DESIGN §6 recovery path)."""\n'
        "# history rules (DESIGN I2, spec §5.3)\n"
        "# the whole round rolls back (spec R25)\n"
        "# see ../shared/spec/crash-recovery.md\n"
        '# CELERY-NOTES "Queues and routing"\n'
        "# the right to scan (issue 15 item 4)\n"
        "# Issue 17: rounds with tools of both kinds\n"
        "# fencing (docs/invariants.md, I6)\n"
        "# see docs/no-such-page.md\n"
        "# a round's tissue 5 and reissue 3 are words, R25 alone is a case name\n"
    )
    lines = [int(v.split(":")[1]) for v in violations(bad, tmp_path)]
    assert lines == [1, 2, 2, 3, 4, 5, 6, 7, 9]
