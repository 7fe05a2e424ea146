"""SSE framing and parsing are linear and bounded by the deadline."""

from __future__ import annotations

import io
import time

import pytest
import requests
import urllib3

from fieldrecovery.deadline import Deadline
from fieldrecovery.errors import DeadlineExceeded
from fieldrecovery.sse import StreamBroken, StreamState, read_events

#: The client's default byte budget: 8 * max_response_chars + 65536.
BUDGET = 8 * 200_000 + 65_536


def _response(body: bytes) -> requests.Response:
    response = requests.Response()
    response.raw = urllib3.HTTPResponse(body=io.BytesIO(body), preload_content=False)
    response.status_code = 200
    return response


def _budget_sized_event(line: bytes = b"data: x\n") -> bytes:
    return _budget_sized_event_of(BUDGET, line)


def _budget_sized_event_of(size: int, line: bytes = b"data: x\n") -> bytes:
    """One event of about ``size`` bytes of short data lines, then ``end``."""
    lines = (size - 200) // len(line)
    return b"id: 1\nevent: message.delta\n" + line * lines + b"\n" + b"id: 2\nevent: end\ndata: {}\n\n"


def _read(body: bytes, seconds: float = 30.0) -> tuple[list[tuple[str, dict[str, object]]], StreamState]:
    state = StreamState()
    events = list(read_events(_response(body), state, Deadline(seconds), byte_budget=BUDGET))
    return events, state


def test_a_budget_sized_event_of_short_lines_is_framed_and_parsed_in_linear_time() -> None:
    body = _budget_sized_event()
    started = time.monotonic()
    events, state = _read(body)
    elapsed = time.monotonic() - started
    assert events == [("end", {})]
    assert state.last_event_id == "2"
    # Not a speed figure (bench/field.py --sse-only prints that: ~0.4 s on a quiet machine): a
    # bound far above linear even on a loaded 2-core machine, far below the quadratic framing
    # it replaced (36 s), so the test fails only if the framing turns quadratic again.
    assert elapsed < 15, f"{elapsed:.1f}s for one {len(body)} byte event"


def test_framing_time_grows_linearly_with_the_event_not_with_its_square() -> None:
    # The budget-sized event against an eighth of it, in this thread's CPU time (other processes
    # on a loaded machine do not count), best of a few runs each, interleaved: linear framing
    # takes ~8x as long for 8x the bytes, the quadratic framing it replaced ~64x (27x measured
    # here for 4x). 24x is the line between them.
    def cpu_seconds(body: bytes) -> float:
        started = time.thread_time()
        events, _ = _read(body)
        elapsed = time.thread_time() - started
        assert events == [("end", {})]
        return elapsed

    full = _budget_sized_event()
    eighth = _budget_sized_event_of(len(full) // 8)
    small, large = [], []
    for _ in range(3):
        small += [cpu_seconds(eighth), cpu_seconds(eighth)]
        large.append(cpu_seconds(full))
    assert min(large) < 24 * min(small), f"{min(large):.3f}s for 8x the bytes of {min(small):.3f}s: not linear"


def test_parsing_a_huge_event_stops_at_the_deadline() -> None:
    # An event of empty data lines (the cheapest lines to send) under a deadline already spent.
    deadline = Deadline(0.0)
    with pytest.raises(DeadlineExceeded):
        list(read_events(_response(_budget_sized_event(b"data:\n")), StreamState(), deadline, byte_budget=BUDGET))


def test_one_huge_chunk_is_framed_with_a_deadline_check_every_few_thousand_lines() -> None:
    # The whole event in ONE read: no per-read check can help; the framing and the event's
    # parse must each ask the deadline at least once per CHECK_EVERY_LINES lines (the CPU work
    # grows with the lines, and the watchdog cannot interrupt CPU work).
    from fieldrecovery.sse import CHECK_EVERY_LINES, EventParser

    class CountingDeadline(Deadline):
        checks = 0

        def check(self) -> None:
            CountingDeadline.checks += 1
            super().check()

    body = _budget_sized_event()
    lines = body.count(b"\n")
    assert [e.name for e in EventParser(CountingDeadline(60)).events([body])] == ["message.delta", "end"]
    assert CountingDeadline.checks >= 2 * (lines // CHECK_EVERY_LINES), (CountingDeadline.checks, lines)


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_every_line_ending_frames_the_same_events(eol: bytes) -> None:
    lines = [b"id: 1", b"event: run.started", b'data: {"run_id":', b'data: "r1"}', b"", b": a comment", b""]
    lines += [b"id: 2", b"event: end", b"", b""]
    body = eol.join(lines)
    events, state = _read(body)
    assert events == [("run.started", {"run_id": "r1"}), ("end", {})]
    assert state.last_event_id == "2"


def test_a_crlf_split_between_two_reads_is_one_line_end() -> None:
    from fieldrecovery.sse import EventParser

    parts = [b'event: run.started\r\ndata: {"run_id":"r1"}\r', b"\n\r", b"\nevent: end\r\n\r\n"]
    names = [e.name for e in EventParser(Deadline(5)).events(parts)]
    assert names == ["run.started", "end"]


def test_a_bare_end_without_data_is_dispatched_as_end() -> None:
    events, _ = _read(b'event: run.started\ndata: {"run_id":"r1"}\n\nid: 9\nevent: end\n\n')
    assert events[-1] == ("end", {})


def test_an_event_cut_before_its_blank_line_is_unterminated_and_not_acknowledged() -> None:
    with pytest.raises(StreamBroken) as info:
        _read(b'id: 1\nevent: run.started\ndata: {"run_id":"r1"}\n\nid: 2\ndata: {"content":"x"}\n')
    assert info.value.code == "sse_unterminated"
