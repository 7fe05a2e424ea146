"""Reading a SuperAgent SSE body: framing, decoding, the byte budget, the event types we use.

``read_events`` yields ``(type, payload)`` for the types the client consumes (``run.started``,
``message.final``, ``error``, ``end``); each must carry a JSON object. Other types
(``message.delta``, ``heartbeat`` …) are skipped whatever their data. An event's id is
acknowledged (``state.last_event_id``) only after the consumer handled it, so a replay resumes
right after the last event that really counted.

Framing and parsing are ours (the WHATWG rules sseclient-py follows), in one linear pass:
sseclient-py's reader yields the unterminated rest of a body as if it were a whole event
(a cut stream looks complete), and both its reader and its parser concatenate ``data += line``, quadratic in
the lines of one event (a budget-sized event of short lines took 36 s of pure CPU, which no
watchdog can interrupt). Here the lines of an event are collected in a list, the byte buffer is
scanned once, and the deadline is checked per chunk, per event and every ``CHECK_EVERY_LINES``
lines. Only blocks that end in a blank line are events; an unterminated rest raises
StreamBroken("sse_unterminated") and its id is never acknowledged. An event without data is
not dispatched (the specification), except ``end``: a bare ``event: end`` ends the stream as
``end`` with ``data: {}`` does. The body is read with ``decode_content=True``: a proxy that compresses an event
stream anyway is decoded, and the budget counts decoded bytes (a compression bomb is refused
like an overlong stream).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import requests
import urllib3.exceptions

from fieldrecovery.deadline import Deadline, response_socket
from fieldrecovery.errors import ProviderOutputInvalid

READ_CHUNK_BYTES = 8192
#: Lines of one event parsed between two deadline checks.
CHECK_EVERY_LINES = 4096
#: The only event types the client reads; every other type is skipped, whatever its data.
CONSUMED_EVENTS = frozenset({"run.started", "message.final", "error", "end"})


class StreamBroken(Exception):
    """The SSE stream stopped before ``end`` (recoverable through the events endpoint)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


#: How a stream read fails when the stream is cut (recoverable through the events endpoint).
BROKEN = (StreamBroken, requests.RequestException, urllib3.exceptions.HTTPError, OSError)


@dataclass
class StreamState:
    last_event_id: str | None = None
    final: str | None = None
    ended: bool = False
    bytes_read: int = 0


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object in ``text``, or None (not JSON, not an object, or nested too deep)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # a hostile nesting depth is "not JSON" too
        return None
    return obj if isinstance(obj, dict) else None


def read_events(
    response: requests.Response, state: StreamState, deadline: Deadline, *, byte_budget: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield the consumed events of ``response`` until its body ends (see the module doc)."""
    parser = EventParser(deadline)
    for event in parser.events(_chunks(response, state, deadline, byte_budget)):
        if event.name in CONSUMED_EVENTS:
            payload = {} if event.name == "end" and not event.data else json_object(event.data)
            if payload is None:
                raise StreamBroken("sse_malformed")
            yield event.name, payload
        if event.id:
            state.last_event_id = event.id
    if parser.unterminated:
        raise StreamBroken("sse_unterminated")


def _chunks(response: requests.Response, state: StreamState, deadline: Deadline, byte_budget: int) -> Iterator[bytes]:
    """Decoded body bytes as they arrive; each read's socket timeout is capped at the time left."""
    raw = response.raw
    while True:
        deadline.check()
        sock = response_socket(response)
        if sock is not None:
            sock.settimeout(deadline.cap(deadline.seconds))
        data = raw.read1(READ_CHUNK_BYTES, decode_content=True)
        if not data:
            return
        state.bytes_read += len(data)
        if state.bytes_read > byte_budget:
            raise ProviderOutputInvalid("the stream exceeds the response budget", code="response_too_large")
        yield data


@dataclass(frozen=True)
class SseEvent:
    name: str
    data: str
    id: str


class EventParser:
    """Cuts a byte stream into SSE events, linear in its size (see the module doc).

    ``unterminated`` is true after ``events`` when the body ended inside an event (anything but
    blank lines after the last blank line); that rest is never parsed or dispatched.
    """

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.unterminated = False

    def events(self, chunks: Iterable[bytes]) -> Iterator[SseEvent]:
        buf = bytearray()  # the bytes after the last complete line: never holds a line end but a final CR
        lines: list[bytes] = []
        count = 0
        for chunk in chunks:
            start = max(len(buf) - 1, 0)
            buf += chunk
            # NOTE: a CR at the very end may be the first half of a CRLF split between chunks.
            end = len(buf) - 1 if buf.endswith(b"\r") else len(buf)
            cut = max(buf.rfind(b"\n", start, end), buf.rfind(b"\r", start, end))
            if cut < 0:
                continue
            complete = bytes(buf[: cut + 1])
            del buf[: cut + 1]
            for line in complete.splitlines():  # bytes.splitlines: CRLF, LF and CR only
                count += 1
                if count % CHECK_EVERY_LINES == 0:
                    self.deadline.check()
                if line:
                    lines.append(line)
                elif lines:
                    event = self._event(lines)
                    lines = []
                    if event is not None:
                        yield event
        if buf.endswith(b"\r"):  # the body's final CR ends a line (a blank line if it is alone)
            if len(buf) > 1:
                lines.append(bytes(buf[:-1]))
            elif lines:
                event = self._event(lines)
                lines = []
                if event is not None:
                    yield event
            buf = bytearray()
        self.unterminated = any(line.strip() for line in lines) or bool(buf.strip())

    def _event(self, lines: list[bytes]) -> SseEvent | None:
        """One event from its lines; None when it carries no data (and is not ``end``)."""
        self.deadline.check()
        name = ""
        event_id = ""
        data: list[str] = []
        try:
            block = b"\n".join(lines).decode("utf-8")  # no line holds a CR or LF any more
        except UnicodeDecodeError:
            raise StreamBroken("sse_malformed") from None
        for count, line in enumerate(block.split("\n"), start=1):
            if count % CHECK_EVERY_LINES == 0:
                self.deadline.check()
            if line.startswith(":") or not line.strip():
                continue
            field, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if field == "data":
                data.append(value)
            elif field == "event":
                name = value
            elif field == "id" and "\x00" not in value:  # the specification ignores an id with a NUL
                event_id = value
        text = "\n".join(data)
        name = name or "message"
        if not text and name != "end":
            return None
        return SseEvent(name, text, event_id)
