"""History rules (R24, partly): normalize() satisfies I2 for any history; tail cleanup."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.history import MALFORMED, check_legal, normalize, parse_tool_calls, tail_garbage
from models import Role


@dataclass
class R:
    id: int
    role: str
    content: str | None = ""
    tool_calls: str | None = None
    tool_call_id: str | None = None
    deleted: bool = False


def calls(*ids: str) -> str:
    return json.dumps([{"id": i, "type": "function", "function": {"name": "echo", "arguments": "{}"}} for i in ids])


IDS = st.sampled_from(["a", "b", "c", "d"])


@st.composite
def histories(draw: st.DrawFn) -> list[R]:
    kinds = draw(st.lists(st.sampled_from(["user", "plain", "round", "tool", "malformed", "system"]), max_size=14))
    rows: list[R] = []
    for kind in kinds:
        nid = len(rows) + 1
        deleted = draw(st.booleans()) and draw(st.booleans())
        if kind == "user":
            rows.append(R(nid, Role.USER, "hi", deleted=deleted))
        elif kind == "system":
            rows.append(R(nid, Role.SYSTEM, "sys", deleted=deleted))
        elif kind == "plain":
            rows.append(R(nid, Role.ASSISTANT, "ok", tool_calls=draw(st.sampled_from([None, "", "[]"]))))
        elif kind == "round":
            ids = draw(st.lists(IDS, min_size=1, max_size=3, unique=True))
            rows.append(R(nid, Role.ASSISTANT, "", tool_calls=calls(*ids), deleted=deleted))
            answered = draw(st.lists(st.sampled_from([*ids, "zz"]), max_size=4))
            for tid in answered:
                rows.append(R(len(rows) + 1, Role.TOOL, "res", tool_call_id=tid, deleted=False))
        elif kind == "tool":
            rows.append(R(nid, Role.TOOL, "res", tool_call_id=draw(IDS), deleted=deleted))
        else:
            bad = draw(st.sampled_from(["{not json", '{"id": "a"}', '[{"id": "a"}]', "[1]", '[{"function": {}}]']))
            rows.append(R(nid, Role.ASSISTANT, "", tool_calls=bad, deleted=deleted))
    return rows


def live(rows: list[R], boundary: int | None = None) -> list[R]:
    return [r for r in rows if not r.deleted and (boundary is None or r.id > boundary)]


@settings(max_examples=400, deadline=None)
@given(histories(), st.one_of(st.none(), st.integers(min_value=0, max_value=10)))
def test_normalize_output_always_satisfies_i2(rows: list[R], boundary: int | None) -> None:
    out = normalize(live(rows, boundary))
    assert check_legal(out) == []
    # idempotent, and it never invents or reorders rows
    assert normalize(out) == out
    ids = [r.id for r in out]
    assert ids == sorted(ids)
    assert all(not r.deleted for r in out)


@settings(max_examples=300, deadline=None)
@given(histories())
def test_normalize_keeps_a_legal_history_whole(rows: list[R]) -> None:
    rows = live(rows)
    if check_legal(rows) == []:
        assert normalize(rows) == rows


@settings(max_examples=300, deadline=None)
@given(histories())
def test_tail_cleanup_only_touches_the_tail_and_leaves_it_legal(rows: list[R]) -> None:
    rows = live(rows)
    removed = set(tail_garbage(rows))
    rounds = [r for r in rows if r.role == Role.ASSISTANT and parse_tool_calls(r.tool_calls) is not None]
    start = rounds[-1].id if rounds else 0
    # Nothing before the last tool round is ever touched: complete rounds are kept.
    assert all(i >= start for i in removed)
    kept_tail = [r for r in rows if r.id >= start and r.id not in removed]
    assert check_legal(kept_tail) == []
    assert all(r.role == Role.TOOL or r.id == start for r in rows if r.id in removed)


def test_parse_tool_calls_classifies() -> None:
    assert parse_tool_calls(None) is None
    assert parse_tool_calls("[]") is None
    assert parse_tool_calls("{oops") is MALFORMED
    assert (
        parse_tool_calls('[{"id": "a", "function": {"name": "x"}}, {"id": "a", "function": {"name": "y"}}]')
        is MALFORMED
    )
    assert parse_tool_calls(calls("a"))[0]["id"] == "a"  # type: ignore[index]


# --- table tests for cleanup_incomplete_tail (pure part) ---


def test_parallel_round_with_one_missing_result_is_removed_whole() -> None:
    rows = [
        R(1, Role.USER, "q"),
        R(2, Role.ASSISTANT, "", calls("a")),
        R(3, Role.TOOL, "ra", tool_call_id="a"),
        R(4, Role.ASSISTANT, "", calls("b", "c")),
        R(5, Role.TOOL, "rb", tool_call_id="b"),
    ]
    assert tail_garbage(rows) == [4, 5]


def test_orphan_tool_after_a_complete_round_is_removed() -> None:
    rows = [
        R(1, Role.USER, "q"),
        R(2, Role.ASSISTANT, "", calls("a")),
        R(3, Role.TOOL, "ra", tool_call_id="a"),
        R(4, Role.TOOL, "dup", tool_call_id="a"),
        R(5, Role.TOOL, "zz", tool_call_id="zz"),
    ]
    assert tail_garbage(rows) == [4, 5]


def test_complete_history_is_untouched() -> None:
    rows = [
        R(1, Role.USER, "q"),
        R(2, Role.ASSISTANT, "", calls("a", "b")),
        R(3, Role.TOOL, "rb", tool_call_id="b"),
        R(4, Role.TOOL, "ra", tool_call_id="a"),
        R(5, Role.ASSISTANT, "done"),
    ]
    assert tail_garbage(rows) == []


def test_malformed_last_round_is_removed_with_its_tools() -> None:
    rows = [R(1, Role.USER, "q"), R(2, Role.ASSISTANT, "", "{broken"), R(3, Role.TOOL, "r", tool_call_id="a")]
    assert tail_garbage(rows) == [2, 3]
