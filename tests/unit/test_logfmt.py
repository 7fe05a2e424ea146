"""The one structured-event helper (DESIGN §9, issue 16 item 5): how values are written, and
the rule that every package logs through it with loggers named by ``__name__``."""

from __future__ import annotations

import json
import logging
import re
from enum import StrEnum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logfmt import fmt, line, log_event

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
