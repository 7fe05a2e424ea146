"""Hostile EML files are EmlInvalid, never another exception."""

from __future__ import annotations

import pytest

from fieldrecovery.eml import parse_eml
from fieldrecovery.errors import EmlInvalid
from tests.field_helpers import sample_eml

CLEAN = sample_eml("ambiguous")


def _with_header(name: str, value: bytes) -> bytes:
    lines = CLEAN.split(b"\n")
    out = [line for line in lines if not line.lower().startswith(name.lower().encode() + b":")]
    return b"\n".join([name.encode() + b": " + value, *out])


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("X-Booking-Revision", "²".encode()),
        ("X-Booking-Revision", b"9" * 5000),
        ("X-Booking-Revision", b"2147483648"),
        ("Message-ID", b"<a\x00b@fixed-channel.example>"),
        ("Message-ID", b"<" + b"m" * 600 + b"@fixed-channel.example>"),
    ],
    ids=["superscript_two", "five_thousand_digits", "above_int32", "nul", "over_512_chars"],
)
def test_a_hostile_header_is_eml_invalid(header: str, value: bytes) -> None:
    with pytest.raises(EmlInvalid) as info:
        parse_eml(_with_header(header, value))
    assert info.value.code == "eml_invalid"


def test_an_unknown_charset_is_eml_invalid_not_a_lookup_error() -> None:
    raw = CLEAN.replace(b"charset=utf-8", b"charset=x-nonexistent")
    with pytest.raises(EmlInvalid):
        parse_eml(raw)


def test_the_largest_int32_revision_is_still_accepted() -> None:
    assert parse_eml(_with_header("X-Booking-Revision", b"2147483647")).source.revision == 2**31 - 1
