"""Hostile EML files end with eml_too_large or eml_invalid in bounded CPU time and memory.

Each case asserts the code, the CPU time (``time.process_time``) and the peak of Python's
allocations (``tracemalloc``), not only the outcome: the standard library's header parser is
quadratic in repeated RFC 2047 encoded words and in Content-Type parameters, its MIME parser
recurses once per nesting level, and a file of 100,000 parts was parsed "ok" in 16 s.
"""

from __future__ import annotations

import base64
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from fieldrecovery.eml import parse_eml
from fieldrecovery.errors import EmlInvalid
from settings import EmlLimitSettings
from tests.field_helpers import sample_eml

CLEAN = sample_eml("ambiguous")
#: CPU seconds and traced megabytes any hostile file below may cost (the old parser: seconds to
#: minutes and hundreds of megabytes on the same files).
CPU_SECONDS = 0.5
PEAK_MB = 40


def _with_header(name: str, value: bytes) -> bytes:
    lines = CLEAN.split(b"\n")
    out = [line for line in lines if not line.lower().startswith(name.lower().encode() + b":")]
    return b"\n".join([name.encode() + b": " + value, *out])


def _encoded_words(count: int) -> bytes:
    return b" ".join([b"=?utf-8?q?a?="] * count)


def _content_type_params(count: int) -> bytes:
    params = b"".join(b";\n p%d=v" % i for i in range(count))
    old = b"Content-Type: text/plain; charset=utf-8"
    assert old in CLEAN
    return CLEAN.replace(old, old + params, 1)


def _parts(count: int) -> bytes:
    head = b"Message-ID: <m1@x>\nMIME-Version: 1.0\nContent-Type: multipart/mixed; boundary=B\n\n"
    return head + b"--B\nContent-Type: text/html\n\nx\n" * count + b"--B--\n"


def _nested(levels: int) -> bytes:
    head = b"Message-ID: <m1@x>\nMIME-Version: 1.0\n"
    body = b"".join(b"Content-Type: multipart/mixed; boundary=b%d\n\n--b%d\n" % (i, i) for i in range(levels))
    return head + body + b"Content-Type: text/plain\n\nAdults: 2\n"


def _base64_part(megabytes: int) -> bytes:
    head = (
        b"Message-ID: <m1@x>\nMIME-Version: 1.0\nContent-Type: text/plain; charset=utf-8\n"
        b"Content-Transfer-Encoding: base64\n\n"
    )
    return head + base64.encodebytes(b"a" * (megabytes << 20))


@contextmanager
def _bounded(cpu_seconds: float = CPU_SECONDS, peak_mb: float = PEAK_MB) -> Iterator[None]:
    tracemalloc.start()
    started = time.process_time()
    try:
        yield
    finally:
        cpu = time.process_time() - started
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    assert cpu < cpu_seconds, f"{cpu:.2f} s of CPU"
    assert peak < peak_mb, f"{peak:.1f} MB traced at the peak"


HOSTILE: dict[str, tuple[Callable[[], bytes], str]] = {
    "encoded_words_in_message_id": (lambda: _with_header("Message-ID", _encoded_words(8000)), "eml_too_large"),
    "encoded_words_in_revision": (lambda: _with_header("X-Booking-Revision", _encoded_words(8000)), "eml_too_large"),
    "encoded_words_under_the_header_limit": (
        lambda: _with_header("Message-ID", _encoded_words(4000)),
        "eml_invalid",
    ),
    "content_type_with_4000_parameters": (lambda: _content_type_params(4000), "SUCCEEDED_PARSE"),
    "content_type_over_the_header_limit": (lambda: _content_type_params(9000), "eml_too_large"),
    "100000_parts": (lambda: _parts(100_000), "eml_too_large"),
    "27_mb_base64_part": (lambda: _base64_part(27), "eml_too_large"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_eml_ends_with_its_code_in_bounded_cpu_time_and_memory(case: str) -> None:
    make, code = HOSTILE[case]
    raw = make()
    with _bounded():
        try:
            parse_eml(raw)
            outcome = "SUCCEEDED_PARSE"
        except EmlInvalid as exc:
            outcome = exc.code
    assert outcome == code


def test_multipart_nesting_past_the_depth_limit_is_too_large_never_a_recursion_error() -> None:
    raw = _nested(1000)
    with _bounded(), pytest.raises(EmlInvalid) as info:
        parse_eml(raw)
    assert info.value.code == "eml_too_large"


def test_nesting_within_a_raised_depth_limit_is_walked_without_recursion() -> None:
    limits = EmlLimitSettings(max_depth=1000, max_parts=2000)
    with _bounded():
        facts = parse_eml(_nested(1000), limits=limits)
    adults = next(f for f in facts.facts if f.field == "adults")
    assert adults.value == "2"


def test_a_message_id_of_a_thousand_open_parentheses_is_eml_invalid() -> None:
    with _bounded(), pytest.raises(EmlInvalid) as info:
        parse_eml(_with_header("Message-ID", b"(" * 1000 + b"<m1@x>"))
    assert info.value.code == "eml_invalid"


@pytest.mark.parametrize(
    ("limits", "raw"),
    [
        (EmlLimitSettings(max_input_bytes=len(CLEAN) - 1), CLEAN),
        (EmlLimitSettings(max_header_bytes=64), CLEAN),
        (EmlLimitSettings(max_parts=2), sample_eml("multipart")),
        (EmlLimitSettings(max_depth=1), sample_eml("multipart")),
    ],
    ids=["input_bytes", "header_bytes", "parts", "depth"],
)
def test_each_limit_is_a_setting_and_a_file_past_it_is_eml_too_large(limits: EmlLimitSettings, raw: bytes) -> None:
    with pytest.raises(EmlInvalid) as info:
        parse_eml(raw, limits=limits)
    assert info.value.code == "eml_too_large"
    assert parse_eml(raw).source.message_id  # the defaults take the same file


@pytest.mark.parametrize(
    "value",
    [b"<m1\n AAA@x>", b"<m1 AAA@x>", b"<m1\r\n\tAAA@x>", b"<m1@x", b"m1@x", b"<m1@x> <m2@x>", b"<>"],
    ids=["folded", "spaced", "folded_crlf_tab", "unclosed", "no_brackets", "two_ids", "empty"],
)
def test_a_message_id_still_invalid_after_unfolding_is_eml_invalid_never_a_cut_key(value: bytes) -> None:
    with pytest.raises(EmlInvalid) as info:
        parse_eml(_with_header("Message-ID", value))
    assert info.value.code == "eml_invalid"


@pytest.mark.parametrize(
    "value",
    [b"<m1@x>", b"\n <m1@x>", b"  <m1@x>  ", b"<m1@x> (sent by the channel)", b"(a (nested) comment) <m1@x>"],
    ids=["plain", "folded_before", "spaced_around", "trailing_comment", "leading_comment"],
)
def test_a_message_id_folded_or_commented_around_the_id_unfolds_to_the_id(value: bytes) -> None:
    assert parse_eml(_with_header("Message-ID", value)).source.message_id == "<m1@x>"
