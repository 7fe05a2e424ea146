"""The reference pages cannot drift from the code: every environment variable `settings.py` reads
is on docs/configuration.md (and nothing there that it no longer reads), every CLI command and
flag is on docs/commands.md, and every process reads the environment through `settings.py` or
names the variable as a test hook here."""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION = ROOT / "docs" / "configuration.md"
COMMANDS = ROOT / "docs" / "commands.md"

#: Environment variables read outside `settings.py`, each on purpose: test and bench hooks of the
#: process stack (never read by a product process), and the variables the CLI passes to a child.
TEST_HOOKS = frozenset(
    {
        "CRASH_POINT_AFTER",  # crashpoints.py: die at the Nth time a point is reached (tests)
        "CRASH_POINT",  # crashpoints.py reads it itself: it imports nothing of the project
        "CRASH_POINT_MODE",  # crashpoints.py: SIGSTOP instead of exiting at the point (stall tests)
    }
)
#: Variables a library's users expect it to honour, read where that library's behaviour is
#: rebuilt: the model client reads requests' CA-bundle variables once per session instead of
#: letting requests scan the environment at every call.
CONVENTIONS = frozenset({"REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"})


def settings_variables() -> set[str]:
    """Every environment variable the settings read: top-level fields, and the nested field
    recovery settings as BOOKING_FIELD_RECOVERY__A__B."""
    from settings import Settings

    names: set[str] = set()

    def walk(prefix: str, model: type[BaseModel]) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(f"{prefix}{name.upper()}__", annotation)
            else:
                names.add(f"{prefix}{name.upper()}")

    walk("", Settings)
    return names


def documented_variables() -> set[str]:
    """The variables the configuration page's tables name: every backticked UPPER_CASE word in
    a table row's first cell, with ``__X`` suffixes after a full name read as that name's siblings
    (``BOOKING_FIELD_RECOVERY__OPEN_API__BASE_URL`` / ``__API_KEY``)."""
    found: set[str] = set()
    for line in CONFIGURATION.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        last = ""
        for word in re.findall(r"`([A-Z_][A-Z0-9_]*)`", cell):
            if word.startswith("__") and last:
                word = last.rsplit("__", 1)[0] + word
            found.add(word)
            last = word
    return found


def test_every_variable_the_settings_read_is_on_the_configuration_page() -> None:
    missing = sorted(settings_variables() - documented_variables())
    assert missing == [], f"docs/configuration.md does not name: {missing}"


def test_the_configuration_page_names_no_variable_the_settings_no_longer_read() -> None:
    stale = sorted(documented_variables() - settings_variables())
    assert stale == [], f"docs/configuration.md names variables settings.py does not read: {stale}"


def test_every_settings_field_says_what_it_is_for() -> None:
    from settings import Settings

    bare = sorted(name for name, field in Settings.model_fields.items() if not (field.description or "").strip())
    assert bare == [], f"settings.py fields without a description: {bare}"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, list[str]]]:
    """(``"session show"``, its option strings) for every leaf command of the CLI."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
        yield " ".join(path), flags
        return
    for name, sub in subs[0].choices.items():
        yield from _commands(sub, (*path, name))


def test_every_cli_command_and_flag_is_on_the_commands_page() -> None:
    from cli.main import build_parser

    rows = [line for line in COMMANDS.read_text().splitlines() if line.startswith("| `agent-recovery ")]
    problems = []
    for command, flags in _commands(build_parser()):
        row = next((r for r in rows if re.match(rf"\| `agent-recovery {re.escape(command)}(?=[ `\]])", r)), None)
        if row is None:
            problems.append(f"agent-recovery {command}: no row")
            continue
        problems += [f"agent-recovery {command}: {flag} undocumented" for flag in flags if flag not in row]
    assert problems == [], "docs/commands.md:\n" + "\n".join(problems)


def _environment_reads(path: Path) -> Iterator[str]:
    """Names read with os.environ[...] / os.environ.get(...) / os.getenv(...) in one module."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            target = node.slice
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
            target = node.args[0] if node.args else None
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            yield target.value


PRODUCT = ("models", "harness", "recovery", "fieldrecovery", "tasks", "cli", "console")


def test_the_product_reads_the_environment_only_through_settings_or_a_named_test_hook() -> None:
    modules = [p for package in PRODUCT for p in (ROOT / package).rglob("*.py")]
    modules += [ROOT / name for name in ("celeryconfig.py", "brokerconfig.py", "crashpoints.py", "logfmt.py")]
    found = sorted(
        f"{p.relative_to(ROOT)}: {name}"
        for p in modules
        for name in _environment_reads(p)
        if name not in TEST_HOOKS | CONVENTIONS
    )
    assert found == [], "read these through settings.py (or name them in TEST_HOOKS with why):\n" + "\n".join(found)
