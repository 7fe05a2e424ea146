"""Reading a SuperAgent SSE body: framing, decoding, the byte budget, the event types we use.

``read_events`` yields ``(type, payload)`` for the types the client consumes (``run.started``,
``message.final``, ``error``, ``end``); each must carry a JSON object. Other types
(``message.delta``, ``heartbeat`` …) are skipped whatever their data. An event's id is
acknowledged (``state.last_event_id``) only after the consumer handled it, so a replay resumes
right after the last event that really counted.

Framing is ours, in front of sseclient-py: its reader yields the unterminated rest of a body as
if it were a whole event (CELERY-NOTES). Here only blocks that end in a blank line reach the
parser; an unterminated rest raises StreamBroken("sse_unterminated") and its id is never
acknowledged. The body is read with ``decode_content=True``: a proxy that compresses an event
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
from sseclient import SSEClient

from fieldrecovery.deadline import Deadline, response_socket
from fieldrecovery.errors import ProviderOutputInvalid

READ_CHUNK_BYTES = 8192
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
    framer = _EventFramer()
    for event in SSEClient(framer.blocks(_chunks(response, state, deadline, byte_budget))).events():
        if event.event in CONSUMED_EVENTS:
            payload = json_object(event.data)
            if payload is None:
                raise StreamBroken("sse_malformed")
            yield event.event, payload
        if event.id:
            state.last_event_id = event.id
    if framer.unterminated:
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


class _EventFramer:
    """Cuts a byte stream into complete SSE event blocks (each ending in a blank line).

    The same line logic as sseclient-py's reader, which would also yield the unterminated rest
    at the end of the body as if it were an event; here that rest is held back and flagged.
    """

    def __init__(self) -> None:
        self.unterminated = False

    def blocks(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        data = b""
        for chunk in chunks:
            for line in chunk.splitlines(True):
                data += line
                if data.endswith((b"\r\r", b"\n\n", b"\r\n\r\n")):
                    yield data
                    data = b""
        self.unterminated = bool(data.strip())
