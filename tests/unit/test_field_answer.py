"""Strict answer parsing: one JSON object, nothing else (docs/field-recovery.md)."""

from __future__ import annotations

import json

import pytest

from fieldrecovery.answer import parse_patch_set
from fieldrecovery.errors import FieldRecoveryError, ProviderOutputInvalid

GOOD = {
    "schema_version": "1",
    "request_id": "frq_1",
    "attempt": 1,
    "idempotency_key": "k" * 64,
    "patches": [
        {
            "task_id": "task-room_type",
            "field": "room_type",
            "path": "booking.room_type",
            "value": "Deluxe King",
            "evidence_refs": ["L7"],
            "candidate_ref": "C3",
            "confidence": 0.9,
        }
    ],
    "unresolved": [{"task_id": "task-arrival_date", "reason": "ambiguous"}],
}


def _code(answer: str, max_chars: int = 10_000) -> str:
    with pytest.raises(ProviderOutputInvalid) as exc:
        parse_patch_set(answer, max_chars=max_chars)
    assert isinstance(exc.value, FieldRecoveryError)
    return exc.value.code


def test_success_json_becomes_a_patch_set() -> None:
    patch_set = parse_patch_set("\n " + json.dumps(GOOD) + "\n", max_chars=10_000)
    assert patch_set.patches[0].value == "Deluxe King"
    assert patch_set.unresolved[0].reason == "ambiguous"


def test_unknown_field_is_refused_at_any_depth() -> None:
    top = dict(GOOD, notes="x")
    nested = json.loads(json.dumps(GOOD))
    nested["patches"][0]["why"] = "because"
    assert _code(json.dumps(top)) == "output_unknown_field"
    assert _code(json.dumps(nested)) == "output_unknown_field"


def test_markdown_fence_is_refused() -> None:
    assert _code("```json\n" + json.dumps(GOOD) + "\n```") == "output_fenced"
    assert _code("~~~\n" + json.dumps(GOOD) + "\n~~~") == "output_fenced"


def test_text_around_the_object_is_refused() -> None:
    assert _code("Here you go: " + json.dumps(GOOD)) == "output_prose"
    assert _code(json.dumps(GOOD) + "\nHope this helps") == "output_prose"


def test_non_json_answers_have_their_own_code() -> None:
    assert _code("I cannot do that.") == "output_not_json"
    assert _code("{not json}") == "output_not_json"
    assert _code(json.dumps(GOOD) + json.dumps(GOOD)) == "output_not_json"  # two objects
    assert _code('{"a": 1, "a": 2}') == "output_not_json"  # duplicate key


def test_oversize_answer_is_refused_before_parsing() -> None:
    text = json.dumps(GOOD)
    assert _code(text, max_chars=len(text) - 1) == "response_too_large"
    assert parse_patch_set(text, max_chars=len(text)).request_id == "frq_1"


def test_contract_violations_without_unknown_fields_are_output_invalid() -> None:
    missing = {k: v for k, v in GOOD.items() if k != "patches"}
    wrong_type = json.loads(json.dumps(GOOD))
    wrong_type["patches"][0]["confidence"] = "0.9"  # strict: no coercion
    out_of_range = json.loads(json.dumps(GOOD))
    out_of_range["patches"][0]["confidence"] = 1.5
    for bad in (missing, wrong_type, out_of_range):
        assert _code(json.dumps(bad)) == "output_invalid"


def test_error_text_never_quotes_the_answer() -> None:
    secret_answer = json.dumps(dict(GOOD, leaked="SECRET-ANSWER-TEXT"))
    with pytest.raises(ProviderOutputInvalid) as exc:
        parse_patch_set(secret_answer, max_chars=10_000)
    assert "SECRET-ANSWER-TEXT" not in str(exc.value)
    assert exc.value.__cause__ is None and exc.value.__suppress_context__


@pytest.mark.parametrize("depth", [2_000, 50_000], ids=["past-the-recursion-limit", "far-past-it"])
def test_deeply_nested_json_under_the_size_cap_is_output_not_json(depth: int) -> None:
    # RecursionError is not a ValueError; it must not escape the parser.
    answer = '{"x":' + "[" * depth + "]" * depth + "}"
    assert len(answer) < 200_000
    with pytest.raises(ProviderOutputInvalid) as exc:
        parse_patch_set(answer, max_chars=200_000)
    assert exc.value.code == "output_not_json"
