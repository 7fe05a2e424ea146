"""SuperAgent Open API stand-in: a real HTTP server on loopback, for tests and the demo.

``agent-recovery superagent-stub serve --port N [--behaviour NAME]`` runs it; tests use
``SuperAgentStub`` (start / stop in-process, switch behaviours, read counters). It implements
the endpoints the client uses, checks ``Authorization: Bearer <key>`` and the CSRF double-submit
(cookie ``csrf_token`` equals header ``X-CSRF-Token``), refuses ``include_trace``
(``open_agent_trace_disabled``, as the parsing agent's external application does), and answers
with a correct RecoveryPatchSet derived from the request (doubles/superagent_agent.py). SSE
responses are chunked by default; with ``chunked=False`` the body is delimited by closing the
connection.

Behaviours (``Behaviour``), one per way a real deployment (or the proxy in front of it) differs:

* answers: normal, fenced, prose, unknown_field, non_json, oversize, bad_patch (one candidate
  value altered), reject_all (every patch altered), deep_json (``{"x":[[[…]]]}`` nested far
  beyond Python's recursion limit, well under the size cap);
* runs: slow (stall before the final answer; a cancel ends it), run_failed (``error`` event),
  status_failed (clean stream, run status failed);
* streams: cut_replayable (cut after ``cut_after`` events, the events endpoint replays),
  cut_unrecoverable (cut, and the events endpoint fails), heartbeat (an ``event: heartbeat``
  with ``data: ping`` before every event), unterminated_at_eof (fields written id, data, event;
  the stream ends cleanly inside an unterminated message.final), replay_in_progress (cut after
  ``run.started``; the run goes on, one event every ``replay_step_seconds``, and the events
  endpoint returns what exists so far and closes);
* HTTP: trace_refused, unauthorized (401), server_error (500), created_201 (session creation
  answers 201 Created), slow_headers (status line and headers one byte every
  ``header_drip_seconds`` on the ``slow_headers_on`` endpoint: ``session`` or ``stream``),
  gzip (gzip bodies, SSE included, when the request accepts gzip), gzip_always (gzip even when
  the request asked for identity, as some proxies do), platform_csrf_cookie (every response
  sets the platform's own ``csrf_token`` cookie and a ``route`` cookie; the CSRF check reads
  the FIRST ``csrf_token`` of the Cookie header, as Go and Spring servers do), gzip_bomb (the
  session response is a gzip body of ``bomb_bytes`` decoded bytes, with status ``bomb_status``,
  whatever the request accepts; with ``bomb_on="stream"`` the message stream is the bomb: a
  ``run.started``, then one ``data:`` line of ``bomb_bytes`` that never ends);
* hostile values: lone_surrogate (a lone surrogate inside the final answer, sent as a
  JSON escape), nul_model / nul_profile (a NUL in the run status's ``model`` or resolved
  profile), huge_tokens (token counts above int32), bare_end (the ``end`` event without a
  ``data:`` line, which the SSE specification never dispatches).

Options of every behaviour (``StubConfig``): ``error_code`` (the ``error`` event's code under
run_failed), ``reported_status`` (the status every run status answers with), ``informational``
(1xx replies written before the response of ``informational_on``), ``event_id_suffix``
(appended to every ``id:``, e.g. a NUL), ``session_id`` / ``run_id`` (handed out instead of
generated ids, e.g. ``..``). Path segments are percent-decoded; ``not_found`` in ``/_stats``
counts requests to a path it does not serve.

Besides ``POST /open/v1/runs/{id}/cancel`` it serves ``POST /open/v1/sessions/{id}/cancel``
(cancel the session's active run), which a client uses when it must stop before it learned the
run id. ``GET /_stats`` returns counters; ``POST /_config`` changes the behaviour of a running
server (operators, demo). Nothing here logs a header value.
"""

from __future__ import annotations

import gzip
import json
import logging
import secrets
import ssl
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from doubles.superagent_agent import Behaviour, StubConfig, answer_text
from fieldrecovery.schemas import canonical_json

__all__ = ["DEFAULT_API_KEY", "Behaviour", "StubConfig", "StubStats", "SuperAgentStub"]

log = logging.getLogger(__name__)

DEFAULT_API_KEY = "df_open_test"


@dataclass
class _Run:
    run_id: str
    session_id: str
    events: list[tuple[int, str, dict[str, Any]]]
    status: str = "running"
    final_status: str = "success"
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: Monotonic time at which each event exists (replay_in_progress); empty: all exist.
    available_at: list[float] = field(default_factory=list)

    def existing(self, now: float) -> list[tuple[int, str, dict[str, Any]]]:
        if not self.available_at:
            return self.events
        return [e for e, at in zip(self.events, self.available_at, strict=True) if at <= now]


@dataclass
class StubStats:
    sessions: int = 0
    streams: int = 0
    run_status: int = 0
    cancels: int = 0
    session_cancels: int = 0
    events_replays: int = 0
    rejected_auth: int = 0
    rejected_csrf: int = 0
    csrf_reused: int = 0
    duplicate_csrf_cookies: int = 0
    include_trace_requests: int = 0
    gzip_responses: int = 0
    #: Requests to a path the stand-in does not serve (answered 404 not_found).
    not_found: int = 0


class _State:
    def __init__(self, api_key: str, config: StubConfig) -> None:
        self.api_key = api_key
        self.config = config
        self.lock = threading.Lock()
        self.stats = StubStats()
        self.sessions: dict[str, str] = {}
        self.runs: dict[str, _Run] = {}
        self.cancelled_runs: list[str] = []
        self.csrf_seen: set[str] = set()
        self.bearer_seen: set[str] = set()
        self.stopping = threading.Event()
        self.counter = 0

    def next_id(self, prefix: str) -> str:
        with self.lock:
            self.counter += 1
            return f"{prefix}_{self.counter:06d}"

    def bump(self, name: str) -> None:
        with self.lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def settle(self, run: _Run) -> None:
        """A run whose every event exists is over: it takes its final status (unless cancelled)."""
        with self.lock:
            if run.status == "running" and len(run.existing(time.monotonic())) == len(run.events):
                run.status = run.final_status


_REASONS = {200: "OK", 201: "Created", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "SuperAgentStub/1"
    state: _State  # set on the subclass made per server
    #: The endpoint being served (``session``, ``stream``, ...), for slow_headers.
    endpoint = ""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("stub %s", format % args)

    # --- plumbing --------------------------------------------------------------------------

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            obj = json.loads(raw or b"{}")
        except ValueError:
            return {}
        return obj if isinstance(obj, dict) else {}

    def _gzip(self) -> bool:
        behaviour = self.state.config.behaviour
        accepts = "gzip" in self.headers.get("Accept-Encoding", "")
        return behaviour == Behaviour.GZIP_ALWAYS or (behaviour == Behaviour.GZIP and accepts)

    def _head(self, status: int, headers: list[tuple[str, str]]) -> None:
        """Write the status line and headers: at once, or one byte at a time (slow_headers)."""
        config = self.state.config
        if config.behaviour == Behaviour.PLATFORM_CSRF_COOKIE:
            headers = [
                *headers,
                ("Set-Cookie", f"csrf_token={secrets.token_urlsafe(16)}; Path=/"),
                ("Set-Cookie", "route=b2; Path=/"),
            ]
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", f"Server: {self.server_version}"]
        lines += [f"{name}: {value}" for name, value in headers]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.log_request(status)
        if config.informational and self.endpoint == config.informational_on:
            for code in config.informational:
                self.wfile.write(f"HTTP/1.1 {code} Informational\r\nLink: </style.css>; rel=preload\r\n\r\n".encode())
            self.wfile.flush()
        if config.behaviour == Behaviour.SLOW_HEADERS and self.endpoint == config.slow_headers_on:
            for i in range(len(head)):
                if self.state.stopping.wait(config.header_drip_seconds):
                    raise ConnectionAbortedError("the stand-in is stopping")
                self.wfile.write(head[i : i + 1])
                self.wfile.flush()
        else:
            self.wfile.write(head)
            self.wfile.flush()

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        headers = [("Content-Type", "application/json")]
        if self._gzip():
            data = gzip.compress(data)
            headers.append(("Content-Encoding", "gzip"))
            self.state.bump("gzip_responses")
        headers.append(("Content-Length", str(len(data))))
        try:
            self._head(status, headers)
            self.wfile.write(data)
        except OSError:  # the client went away (a watchdog shut its socket down)
            self.close_connection = True

    def _send_bomb(self, session_id: str) -> None:
        """A small gzip body that decodes to ``bomb_bytes`` (zeros for 401, spaces inside JSON for 200)."""
        config = self.state.config
        compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
        if config.bomb_status == 200:
            head, filler, tail = b'{"session_id": "' + session_id.encode() + b'", "pad": "', b" ", b'"}'
        else:
            head, filler, tail = b'{"error": {"code": "unauthorized", "pad": "', b"0", b'"}}'
        parts = [compressor.compress(head)]
        block = filler * 1_000_000
        for _ in range(config.bomb_bytes // len(block)):
            parts.append(compressor.compress(block))
        parts.append(compressor.compress(tail) + compressor.flush())
        data = b"".join(parts)
        self.state.bump("gzip_responses")
        headers = [("Content-Type", "application/json"), ("Content-Encoding", "gzip")]
        headers.append(("Content-Length", str(len(data))))
        try:
            self._head(config.bomb_status, headers)
            self.wfile.write(data)
        except OSError:
            self.close_connection = True

    def _send_stream_bomb(self, run: _Run) -> None:
        """The message stream as a small gzip body: ``run.started``, then a ``data:`` line of
        ``bomb_bytes`` decoded bytes that never ends (whatever the request accepts)."""
        compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
        parts = [compressor.compress(self._frame(1, "run.started", {"run_id": run.run_id}) + b"data: ")]
        block = b"0" * 1_000_000
        for _ in range(self.state.config.bomb_bytes // len(block)):
            parts.append(compressor.compress(block))
        data = b"".join(parts) + compressor.flush()
        self.state.bump("gzip_responses")
        headers = [("Content-Type", "text/event-stream"), ("Content-Encoding", "gzip")]
        headers.append(("Content-Length", str(len(data))))
        try:
            self._head(200, headers)
            self.wfile.write(data)
        except OSError:
            self.close_connection = True

    def _error(self, status: int, code: str) -> None:
        self._send_json(status, {"error": {"code": code}})

    def _csrf_cookie(self) -> str | None:
        """The csrf_token cookie the server reads: the FIRST of its name (Go, Spring) or the only one."""
        values = []
        for part in self.headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == "csrf_token":
                values.append(value)
        if len(values) > 1:
            self.state.bump("duplicate_csrf_cookies")
        if self.state.config.behaviour == Behaviour.PLATFORM_CSRF_COOKIE:
            return values[0] if values else None
        cookie = SimpleCookie()
        try:
            cookie.load(self.headers.get("Cookie", ""))
        except CookieError:
            return None
        morsel = cookie.get("csrf_token")
        return None if morsel is None else morsel.value

    def _authorized(self) -> bool:
        state = self.state
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""
        with state.lock:
            state.bearer_seen.add(token)
        if state.config.behaviour == Behaviour.UNAUTHORIZED or token != state.api_key:
            state.bump("rejected_auth")
            self._error(401, "unauthorized")
            return False
        header = self.headers.get("X-CSRF-Token", "")
        if len(header) < 16 or self._csrf_cookie() != header:
            state.bump("rejected_csrf")
            self._error(403, "csrf_failed")
            return False
        with state.lock:
            if header in state.csrf_seen:
                state.stats.csrf_reused += 1
            state.csrf_seen.add(header)
        if state.config.behaviour == Behaviour.SERVER_ERROR:
            self._error(500, "internal_error")
            return False
        return True

    # --- routing ---------------------------------------------------------------------------

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        parts = [unquote(part) for part in url.path.strip("/").split("/")]
        if url.path == "/_stats":
            with self.state.lock:
                stats = asdict(self.state.stats)
            self._send_json(200, stats)
            return
        if len(parts) == 4 and parts[:3] == ["open", "v1", "runs"]:
            self.endpoint = "run"
            self.state.bump("run_status")
            if self._authorized():
                self._run_status(parts[3])
            return
        if len(parts) == 5 and parts[:3] == ["open", "v1", "runs"] and parts[4] == "events":
            self.endpoint = "events"
            self.state.bump("events_replays")
            if self._authorized():
                after = parse_qs(url.query).get("after", ["0"])[0]
                self._replay(parts[3], int(after) if after.isdigit() else 0)
            return
        self.state.bump("not_found")
        self._error(404, "not_found")

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        parts = [unquote(part) for part in url.path.strip("/").split("/")]
        body = self._body()
        if url.path == "/_config":
            try:
                config = StubConfig.from_json(body)
            except (TypeError, ValueError):
                self._error(400, "bad_config")
                return
            with self.state.lock:
                self.state.config = config
            self._send_json(200, {"behaviour": config.behaviour.value})
            return
        if parts == ["open", "v1", "sessions"]:
            self.endpoint = "session"
            self.state.bump("sessions")
            if self._authorized():
                self._create_session(body)
            return
        if len(parts) == 6 and parts[:3] == ["open", "v1", "sessions"] and parts[4:] == ["messages", "stream"]:
            self.endpoint = "stream"
            self.state.bump("streams")
            if body.get("include_trace"):
                self.state.bump("include_trace_requests")
            if self._authorized():
                self._stream(parts[3], body)
            return
        if len(parts) == 5 and parts[:3] == ["open", "v1", "runs"] and parts[4] == "cancel":
            self.endpoint = "cancel"
            self.state.bump("cancels")
            if self._authorized():
                self._cancel(parts[3])
            return
        if len(parts) == 5 and parts[:3] == ["open", "v1", "sessions"] and parts[4] == "cancel":
            self.endpoint = "cancel"
            self.state.bump("session_cancels")
            if self._authorized():
                self._cancel_session(parts[3])
            return
        self.state.bump("not_found")
        self._error(404, "not_found")

    # --- endpoints -------------------------------------------------------------------------

    def _create_session(self, body: dict[str, Any]) -> None:
        subject = body.get("external_subject_id")
        if not isinstance(subject, str) or len(subject) != 64:
            self._error(400, "invalid_external_subject_id")
            return
        session_id = self.state.config.session_id or self.state.next_id("ses")
        with self.state.lock:
            self.state.sessions[session_id] = subject
        if self.state.config.behaviour == Behaviour.GZIP_BOMB and self.state.config.bomb_on == "session":
            self._send_bomb(session_id)
            return
        status = 201 if self.state.config.behaviour == Behaviour.CREATED_201 else 200
        self._send_json(status, {"session_id": session_id})

    def _stream(self, session_id: str, body: dict[str, Any]) -> None:
        state = self.state
        config = state.config
        if session_id not in state.sessions:
            self._error(404, "session_not_found")
            return
        if body.get("include_trace") or config.behaviour == Behaviour.TRACE_REFUSED:
            self._error(400, "open_agent_trace_disabled")
            return
        content = body.get("content")
        if not isinstance(content, str) or not isinstance(body.get("idempotency_key"), str):
            self._error(400, "invalid_message")
            return
        try:
            answer = answer_text(content, config)
        except ValueError:
            self._error(400, "invalid_message")
            return
        run = _Run(run_id=config.run_id or state.next_id("run"), session_id=session_id, events=[])
        events: list[tuple[str, dict[str, Any]]] = [("run.started", {"run_id": run.run_id})]
        if config.behaviour == Behaviour.RUN_FAILED:
            events += [("error", {"code": config.error_code}), ("end", {})]
            run.final_status = "failed"
        else:
            half = len(answer) // 2
            events += [
                ("message.delta", {"delta": answer[:half]}),
                ("message.delta", {"delta": answer[half:]}),
                ("message.final", {"content": answer}),
                ("end", {}),
            ]
            if config.behaviour == Behaviour.STATUS_FAILED:
                run.final_status = "failed"
        run.events = [(i, name, data) for i, (name, data) in enumerate(events, start=1)]
        if config.behaviour == Behaviour.REPLAY_IN_PROGRESS:
            now = time.monotonic()
            run.available_at = [now + i * config.replay_step_seconds for i in range(len(run.events))]
        with state.lock:
            state.runs[run.run_id] = run
        if config.behaviour == Behaviour.GZIP_BOMB and config.bomb_on == "stream":
            self._send_stream_bomb(run)
            return
        cut_after: int | None = None
        if config.behaviour in (Behaviour.CUT_REPLAYABLE, Behaviour.CUT_UNRECOVERABLE):
            cut_after = config.cut_after
        elif config.behaviour == Behaviour.REPLAY_IN_PROGRESS:
            cut_after = 1
        self._write_events(run, run.events, config, cut_after=cut_after)

    def _replay(self, run_id: str, after: int) -> None:
        state = self.state
        run = state.runs.get(run_id)
        if run is None:
            self._error(404, "run_not_found")
            return
        if state.config.behaviour == Behaviour.CUT_UNRECOVERABLE:
            self._error(503, "events_unavailable")
            return
        existing = run.existing(time.monotonic())
        self._write_events(
            run, [e for e in existing if e[0] > after], replace(state.config, event_delay=0.0), replay=True
        )

    def _run_status(self, run_id: str) -> None:
        run = self.state.runs.get(run_id)
        if run is None:
            self._error(404, "run_not_found")
            return
        if run.available_at:
            self.state.settle(run)
        behaviour = self.state.config.behaviour
        tokens = 2**31 if behaviour == Behaviour.HUGE_TOKENS else 1
        self._send_json(
            200,
            {
                "run_id": run.run_id,
                "status": self.state.config.reported_status or run.status,
                "metadata": {
                    "resolved_profile_id": "prof_fixed\x00channel"
                    if behaviour == Behaviour.NUL_PROFILE
                    else "prof_fixed_channel_recovery",
                    "resolved_profile_version": "7",
                },
                "model": "superagent\x00stub-1" if behaviour == Behaviour.NUL_MODEL else "superagent-stub-1",
                "usage": {
                    "prompt_tokens": 812 * tokens,
                    "completion_tokens": 164 * tokens,
                    "total_tokens": 976 * tokens,
                },
            },
        )

    def _cancel(self, run_id: str) -> None:
        run = self.state.runs.get(run_id)
        if run is None:
            self._error(404, "run_not_found")
            return
        self._mark_cancelled(run)
        self._send_json(200, {"run_id": run_id, "status": run.status})

    def _cancel_session(self, session_id: str) -> None:
        if session_id not in self.state.sessions:
            self._error(404, "session_not_found")
            return
        with self.state.lock:
            runs = [r for r in self.state.runs.values() if r.session_id == session_id and r.status == "running"]
        for run in runs:
            self._mark_cancelled(run)
        self._send_json(200, {"session_id": session_id, "cancelled_runs": [r.run_id for r in runs]})

    def _mark_cancelled(self, run: _Run) -> None:
        with self.state.lock:
            self.state.cancelled_runs.append(run.run_id)
            if run.status == "running":
                run.status = "cancelled"
        run.cancelled.set()

    # --- SSE writing -----------------------------------------------------------------------

    def _frame(self, event_id: int, name: str, data: dict[str, Any]) -> bytes:
        payload = canonical_json(data)
        if self.state.config.behaviour == Behaviour.LONE_SURROGATE:
            payload = json.dumps(data, sort_keys=True, separators=(",", ":"))  # the surrogate as an escape
        if self.state.config.behaviour == Behaviour.BARE_END and name == "end":
            return f"id: {event_id}\nevent: end\n\n".encode()
        ident = f"{event_id}{self.state.config.event_id_suffix}"
        if self.state.config.behaviour == Behaviour.UNTERMINATED_AT_EOF:
            return f"id: {ident}\ndata: {payload}\nevent: {name}\n\n".encode()
        return f"id: {ident}\nevent: {name}\ndata: {payload}\n\n".encode()

    def _write_events(
        self,
        run: _Run,
        events: list[tuple[int, str, dict[str, Any]]],
        config: StubConfig,
        cut_after: int | None = None,
        replay: bool = False,
    ) -> None:
        headers = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")]
        compressor = None
        if self._gzip():
            compressor = zlib.compressobj(wbits=31)  # gzip container, flushed per event
            headers.append(("Content-Encoding", "gzip"))
            self.state.bump("gzip_responses")
        if config.chunked:
            headers.append(("Transfer-Encoding", "chunked"))
        else:
            headers.append(("Connection", "close"))
            self.close_connection = True
        writer = _BodyWriter(self, config.chunked, compressor)
        try:
            self._head(200, headers)
            for count, (event_id, name, data) in enumerate(events):
                frame = self._frame(event_id, name, data)
                if cut_after is not None and count >= cut_after:
                    if config.cut_mid_event:
                        writer.write(frame[: len(frame) // 2])
                    self._cut()
                    return
                if config.behaviour == Behaviour.UNTERMINATED_AT_EOF and name == "message.final" and not replay:
                    # A clean end of the body inside the event: "id" and "data" but no "event"
                    # line and no blank line. A client must drop it, not acknowledge its id.
                    writer.write(frame[: frame.index(b"\nevent:") + 1])
                    writer.finish()
                    return
                slow = name == "message.final" and config.behaviour == Behaviour.SLOW
                if slow and not self._stall(run, config, writer):
                    return
                if config.event_delay:
                    self.state.stopping.wait(config.event_delay)
                if config.behaviour == Behaviour.HEARTBEAT:
                    writer.write(b"event: heartbeat\ndata: ping\n\n")
                if name == "end":  # the run is over before the client can ask for its status
                    with self.state.lock:
                        if run.status == "running":
                            run.status = run.final_status
                writer.write(frame)
            writer.finish()
        except OSError:  # the client went away (deadline watchdog): nothing more to send
            self.close_connection = True

    def _stall(self, run: _Run, config: StubConfig, writer: _BodyWriter) -> bool:
        """Wait before the final answer; False when the run was cancelled or the server stops."""
        waited = 0.0
        step = 0.2 if config.drip else config.stall_seconds
        while waited < config.stall_seconds:
            if run.cancelled.wait(min(step, config.stall_seconds - waited)) or self.state.stopping.is_set():
                self.close_connection = True
                return False
            waited += step
            if config.drip:
                writer.write(b": keepalive\n\n")
        return True

    def _cut(self) -> None:
        """Drop the connection mid-stream (no terminating chunk)."""
        self.wfile.flush()
        self.close_connection = True
        try:
            self.connection.shutdown(2)
        except OSError:
            pass


class _BodyWriter:
    """Writes body bytes: optionally gzip-compressed (sync-flushed per write), optionally chunked."""

    def __init__(self, handler: _Handler, chunked: bool, compressor: Any) -> None:
        self._handler = handler
        self._chunked = chunked
        self._compressor = compressor

    def write(self, data: bytes) -> None:
        if self._compressor is not None:
            data = self._compressor.compress(data) + self._compressor.flush(zlib.Z_SYNC_FLUSH)
        self._raw(data)

    def finish(self) -> None:
        if self._compressor is not None:
            self._raw(self._compressor.flush())
        if self._chunked:
            self._handler.wfile.write(b"0\r\n\r\n")
        self._handler.wfile.flush()

    def _raw(self, data: bytes) -> None:
        if not data:
            return
        wfile = self._handler.wfile
        if self._chunked:
            wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        else:
            wfile.write(data)
        wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up (a watchdog's shutdown, a cut) is normal here: no traceback."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class SuperAgentStub:
    """The stand-in server, started and stopped in-process (``with SuperAgentStub() as stub``)."""

    def __init__(
        self,
        *,
        api_key: str = DEFAULT_API_KEY,
        host: str = "127.0.0.1",
        port: int = 0,
        config: StubConfig | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """``ssl_context`` (a server context with its certificate loaded) serves HTTPS instead."""
        self._state = _State(api_key, config or StubConfig())
        handler = type("_BoundHandler", (_Handler,), {"state": self._state})
        self._server = _Server((host, port), handler)
        self._server.daemon_threads = True
        self._tls = ssl_context is not None
        if ssl_context is not None:
            # NOTE: the handshake runs in the handler's thread (first read), not in accept().
            self._server.socket = ssl_context.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{'https' if self._tls else 'http'}://{host!s}:{port}"

    def start(self) -> SuperAgentStub:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="superagent-stub", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop(self) -> None:
        self._state.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> SuperAgentStub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def configure(self, **changes: Any) -> None:
        """Switch behaviour or options, e.g. ``stub.configure(behaviour=Behaviour.SLOW)``."""
        with self._state.lock:
            self._state.config = replace(self._state.config, **changes)

    def stats(self) -> dict[str, int]:
        with self._state.lock:
            return asdict(self._state.stats)

    @property
    def cancelled_runs(self) -> list[str]:
        with self._state.lock:
            return list(self._state.cancelled_runs)

    @property
    def bearer_tokens_seen(self) -> set[str]:
        with self._state.lock:
            return set(self._state.bearer_seen)

    def run_status(self, run_id: str) -> str | None:
        run = self._state.runs.get(run_id)
        return None if run is None else run.status

    def runs_of_session(self, session_id: str) -> list[str]:
        with self._state.lock:
            return [r.run_id for r in self._state.runs.values() if r.session_id == session_id]
