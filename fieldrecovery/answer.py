"""Strict deserialization of the provider's final answer into a RecoveryPatchSet.

The answer must be exactly one JSON object (surrounding whitespace allowed). Each way of being
wrong has its own safe code, checked in this order:

``response_too_large``  longer than max_response_chars
``output_fenced``       contains a Markdown code fence
``output_prose``        text before or after the object
``output_not_json``     not parsable JSON (nesting too deep included), not an object, or a key
                        given twice
``output_bad_text``     a lone surrogate or a NUL, in the text or in any string of the object
                        (neither can be hashed or stored)
``output_unknown_field`` a field the contract does not have
``output_invalid``      any other contract violation (missing field, wrong type, range)

Errors never carry the answer's text: pydantic's messages quote the input, so they are
dropped (``from None``).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from fieldrecovery.errors import ProviderOutputInvalid
from fieldrecovery.schemas import RecoveryPatchSet, storable_text


def parse_patch_set(answer: str, *, max_chars: int) -> RecoveryPatchSet:
    """Return the PatchSet in ``answer`` or raise ProviderOutputInvalid with a distinct code."""
    if len(answer) > max_chars:
        raise ProviderOutputInvalid("the answer exceeds max_response_chars", code="response_too_large")
    if not storable_text(answer):
        raise ProviderOutputInvalid("the answer has a lone surrogate or a NUL", code="output_bad_text")
    if "```" in answer or "~~~" in answer:
        raise ProviderOutputInvalid("the answer is wrapped in a Markdown fence", code="output_fenced")
    text = answer.strip()
    if not text.startswith("{") or not text.endswith("}"):
        if "{" in text and "}" in text:
            raise ProviderOutputInvalid("the answer has text around the JSON object", code="output_prose")
        raise ProviderOutputInvalid("the answer is not JSON", code="output_not_json")
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError):
        # NOTE: RecursionError is not a ValueError: a nesting depth far below the size cap
        # ({"x":[[[…]]]}) exhausts the parser's stack; it is "not JSON", failed closed.
        raise ProviderOutputInvalid("the answer is not one JSON object", code="output_not_json") from None
    if not isinstance(obj, dict):
        raise ProviderOutputInvalid("the answer is not a JSON object", code="output_not_json")
    # NOTE: JSON escapes (a backslash-u D800 or 0000) hide what the raw-text check cannot see.
    if not _all_storable(obj):
        raise ProviderOutputInvalid("the answer has a lone surrogate or a NUL", code="output_bad_text")
    try:
        return RecoveryPatchSet.model_validate(obj)
    except ValidationError as exc:
        kinds = {err["type"] for err in exc.errors()}
        if "extra_forbidden" in kinds:
            raise ProviderOutputInvalid("the answer has an unknown field", code="output_unknown_field") from None
        raise ProviderOutputInvalid("the answer violates the PatchSet contract", code="output_invalid") from None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError("duplicate key")
        result[key] = value
    return result


def _all_storable(obj: Any) -> bool:
    """Every key and string inside ``obj`` is storable (iterative: a deep nesting cannot recurse)."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not storable_text(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True
