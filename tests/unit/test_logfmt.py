"""The one structured-event helper (docs/invariants.md, I8): how values are written, and
the rule that every package logs through it with loggers named by ``__name__``."""

from __future__ import annotations

import ast
import json
import logging
import re
from enum import StrEnum
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logfmt import fmt, line, log_event

ROOT = Path(__file__).resolve().parents[2]

_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse(text: str) -> dict[str, str]:
    """A reader's view of one line: ``key=value`` pairs, a quoted value decoded as JSON."""
    pairs: dict[str, str] = {}
    for key, raw in _PAIR.findall(text):
        assert key not in pairs, f"{key} twice in {text!r}"
        pairs[key] = json.loads(raw) if raw.startswith('"') else raw
    return pairs


class Colour(StrEnum):
    RED = "RED"


def test_none_is_a_dash_and_bools_are_lowercase_words() -> None:
    assert fmt(None) == "-"
    assert (fmt(True), fmt(False)) == ("true", "false")


def test_lists_are_joined_with_commas_and_an_empty_list_is_a_dash() -> None:
    assert fmt([3, 1, 2]) == "3,1,2"
    assert fmt((7,)) == "7"
    assert fmt([]) == "-"
    assert fmt(["a b", None]) == '"a b",-'


def test_values_with_blanks_equals_signs_or_quotes_are_quoted_and_plain_ones_are_not() -> None:
    assert fmt("stale_epoch") == "stale_epoch"
    assert fmt("celery@host-1") == "celery@host-1"
    assert fmt("two words") == '"two words"'
    assert fmt("a=b") == '"a=b"'
    assert fmt('say "hi"') == '"say \\"hi\\""'
    assert fmt("line\nbreak") == '"line\\nbreak"'
    assert fmt("") == '""'


def test_numbers_and_enums_are_written_as_their_values() -> None:
    assert fmt(42) == "42"
    assert fmt(1.23456) == "1.235"
    assert fmt(Colour.RED) == "RED"


def test_a_line_is_the_event_then_the_fields_in_the_order_given() -> None:
    assert line("parent_recovery_wait", parent_id=3, execution_ids=[7, 8]) == (
        "event=parent_recovery_wait parent_id=3 execution_ids=7,8"
    )
    assert line("scan_right_not_released") == "event=scan_right_not_released"


NAMES = st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True).filter(lambda k: k != "event")


@given(st.dictionaries(NAMES, st.text().filter(lambda v: v != "-")))  # "-" is how None is written
def test_any_text_value_reads_back_as_itself_and_cannot_forge_another_field(fields: dict[str, str]) -> None:
    written = line("e", **fields)
    assert "\n" not in written
    assert parse(written) == {"event": "e", **fields}


def test_log_event_logs_one_line_at_its_level_from_the_callers_line(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("tests.logfmt")
    with caplog.at_level(logging.INFO, logger="tests.logfmt"):
        log_event(log, "quiet", logging.DEBUG, execution_id=1)
        log_event(log, "child_lost", execution_id=7, epoch=2)
        try:
            raise ValueError("not logged as text")
        except ValueError:
            log_event(log, "child_failed", logging.WARNING, exc_info=True, execution_id=7, error="ValueError")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "event=child_lost execution_id=7 epoch=2"),
        (logging.WARNING, "event=child_failed execution_id=7 error=ValueError"),
    ]
    assert not caplog.records[0].exc_info and caplog.records[1].exc_info
    assert {r.pathname for r in caplog.records} == {__file__}  # the caller's line, not the helper's


def test_the_infrastructure_boundary_logs_its_event_with_the_error_type_only(caplog: pytest.LogCaptureFixture) -> None:
    from sqlalchemy.exc import OperationalError

    from harness.errors import infrastructure_boundary

    log = logging.getLogger("tests.logfmt")
    with caplog.at_level(logging.WARNING, logger="tests.logfmt"):
        with infrastructure_boundary(log, "agent_run_infra_error", session_id=3) as fault:
            raise OperationalError("SELECT 1", {}, Exception("server closed the connection: password=hunter2"))
        with pytest.raises(ValueError), infrastructure_boundary(log, "agent_run_infra_error", session_id=4):
            raise ValueError("a result, not a fault")
    assert fault
    assert [r.getMessage() for r in caplog.records] == [
        "event=agent_run_infra_error session_id=3 error=OperationalError"
    ]


# -- the rule: every package logs through log_event, loggers by __name__ ----------------------

#: Packages (and top-level modules) whose log lines must go through ``log_event``.
CHECKED = (
    "harness",
    "recovery",
    "tasks",
    "cli",
    "models",
    "fieldrecovery",
    "doubles",
    "demo",
    "devstack",
    "crashpoints.py",
)

#: Files another change is editing right now; each still breaks the rule, and the test below
#: fails once it no longer does, so the entry is removed and the rule then holds there too.
PENDING: frozenset[str] = frozenset()

_LOG_METHODS = frozenset({"debug", "info", "warning", "error", "exception", "critical", "log"})
_EVENT_HELPERS = frozenset({"log_event", "line", "infrastructure_boundary"})
#: Spellings retired for the one in logfmt's docstring (``execution=`` is ``execution_id=``, ...).
_RETIRED = frozenset({"execution", "session", "parent", "child", "journal", "round", "code"})
_SNAKE = re.compile(r"[a-z][a-z0-9_]*")
#: A ``key=`` inside a logger's format string: ``"x=%s"``, ``"x=%d"``, an f-string's ``x={...}``.
_RAW_FIELD = re.compile(r"\b\w+=(%|$)")


def _sources() -> list[Path]:
    out: list[Path] = []
    for name in CHECKED:
        path = ROOT / name
        out += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return out


def _texts(node: ast.AST) -> list[str]:
    """The literal text pieces inside an argument (a plain string, an f-string's parts, a +)."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _misspelt(name: str) -> bool:
    return name in _RETIRED or not _SNAKE.fullmatch(name)


def violations(path: Path, root: Path = ROOT) -> list[str]:
    """Raw structured lines and loggers not named by ``__name__`` in one source file."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        method = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        texts = [t for arg in node.args for t in _texts(arg)]
        if method == "getLogger" and node.args and isinstance(node.args[0], ast.Constant):
            found.append((node.lineno, f"getLogger({node.args[0].value!r}), not getLogger(__name__)"))
        elif method in _LOG_METHODS and any("event=" in t or _RAW_FIELD.search(t) for t in texts):
            found.append((node.lineno, "a key=value format string, not log_event"))
        elif method in {"print", "write"} and any(t.startswith("event=") for t in texts):
            found.append((node.lineno, "a raw event= line written by hand, not log_event"))
        elif method in _EVENT_HELPERS:
            names = [k.arg for k in node.keywords if k.arg is not None]
            found += [(node.lineno, f"field {n}=, spelled otherwise in logfmt") for n in names if _misspelt(n)]
    return [f"{path.relative_to(root)}:{lineno}: {what}" for lineno, what in sorted(found)]


def test_no_module_writes_a_raw_event_line_or_names_its_logger_by_hand() -> None:
    found = [v for path in _sources() if str(path.relative_to(ROOT)) not in PENDING for v in violations(path)]
    assert found == [], "log through logfmt.log_event with getLogger(__name__):\n" + "\n".join(found)


def test_each_pending_file_still_needs_its_exception() -> None:
    done = sorted(name for name in PENDING if not violations(ROOT / name))
    assert done == [], f"these now follow the rule: remove them from PENDING: {done}"


def test_the_rule_sees_the_shapes_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import logging\n"
        'log = logging.getLogger("harness.loop")\n'
        'log.info("event=child_lost executionId=%s", 1)\n'
        'log.info("model_call_failed status=%d", 500)\n'
        'log.log(logging.WARNING, f"event={name} error=%s", "E")\n'
        'print("event=worker_ready")\n'
        'log_event(log, "child_lost", execution_id=1)\n'
        'with infrastructure_boundary(log, "child_infra_error", executionId=1): pass\n'
        'log_event(log, "redeliver", parent=3, outcome="nothing_pending")\n'
        'log.warning("the database did not answer", exc_info=True)\n'
    )
    lines = [int(v.split(":")[1]) for v in violations(bad, tmp_path)]
    assert lines == [2, 3, 4, 5, 6, 8, 9]
