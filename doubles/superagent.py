"""SuperAgent Open API stand-in: a real HTTP server on loopback, for tests and the demo.

``agent-recovery superagent-stub serve --port N`` runs it; tests use ``SuperAgentStub`` (start /
stop in-process, switch behaviours, read counters). It implements the endpoints the client
uses, checks ``Authorization: Bearer <key>`` and the CSRF double-submit (cookie ``csrf_token``
equals header ``X-CSRF-Token``), refuses ``include_trace`` (``open_agent_trace_disabled``, as
the parsing agent's external application does), and answers with a correct RecoveryPatchSet
derived from the request (doubles/superagent_agent.py). SSE responses are chunked by default; with
``chunked=False`` the body is delimited by closing the connection.

Behaviours (``Behaviour``): normal, slow (stall before the final answer; a cancel ends it),
cut_replayable (stream cut after ``cut_after`` events, the events endpoint replays),
cut_unrecoverable (cut, and the events endpoint fails), fenced, prose, unknown_field,
non_json, oversize, bad_patch (a candidate value that does not match its ref), run_failed
(``error`` event, run status failed), status_failed (clean stream, run status failed),
trace_refused, unauthorized (401), server_error (500).

``GET /_stats`` returns counters: sessions, streams, run_status, cancels, events_replays and
the rejections. ``POST /_config`` changes the behaviour of a running server (operators, demo).
Nothing here logs a header value.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from doubles.superagent_agent import answer_for
from recovery.field.request_builder import parse_message
from recovery.field.schemas import canonical_json

log = logging.getLogger("doubles.superagent")

DEFAULT_API_KEY = "df_open_test"


class Behaviour(StrEnum):
    NORMAL = "normal"
    SLOW = "slow"
    CUT_REPLAYABLE = "cut_replayable"
    CUT_UNRECOVERABLE = "cut_unrecoverable"
    FENCED = "fenced"
    PROSE = "prose"
    UNKNOWN_FIELD = "unknown_field"
    NON_JSON = "non_json"
    OVERSIZE = "oversize"
    BAD_PATCH = "bad_patch"
    RUN_FAILED = "run_failed"
    STATUS_FAILED = "status_failed"
    TRACE_REFUSED = "trace_refused"
    UNAUTHORIZED = "unauthorized"
    SERVER_ERROR = "server_error"


@dataclass(frozen=True)
class StubConfig:
    behaviour: Behaviour = Behaviour.NORMAL
    #: Chunked transfer encoding for SSE; False delimits the body by closing the connection.
    chunked: bool = True
    #: cut_*: complete events written before the cut.
    cut_after: int = 3
    #: cut_*: also write the first half of the next event before cutting.
    cut_mid_event: bool = False
    #: Pause between events (all behaviours).
    event_delay: float = 0.0
    #: slow: silence before message.final (a cancel or stop ends it).
    stall_seconds: float = 30.0
    #: slow: send a ``: keepalive`` comment every 0.2 s while stalling (defeats read timeouts).
    drip: bool = False
    #: oversize: characters of padding added to the answer.
    oversize_chars: int = 250_000

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StubConfig:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "behaviour" in values:
            values["behaviour"] = Behaviour(values["behaviour"])
        return cls(**values)


@dataclass
class _Run:
    run_id: str
    session_id: str
    events: list[tuple[int, str, dict[str, Any]]]
    status: str = "running"
    final_status: str = "success"
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class StubStats:
    sessions: int = 0
    streams: int = 0
    run_status: int = 0
    cancels: int = 0
    events_replays: int = 0
    rejected_auth: int = 0
    rejected_csrf: int = 0
    csrf_reused: int = 0
    include_trace_requests: int = 0


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


def _answer_text(request_content: str, config: StubConfig) -> str:
    patch_set = answer_for(parse_message(request_content)).model_dump(mode="json")
    behaviour = config.behaviour
    if behaviour == Behaviour.BAD_PATCH and patch_set["patches"]:
        first = patch_set["patches"][0]
        first["value"] = first["value"] + "x"  # no longer the value of its candidate ref
    if behaviour == Behaviour.UNKNOWN_FIELD:
        patch_set["reasoning"] = "chosen by evidence"
    text = json.dumps(patch_set, ensure_ascii=False)
    if behaviour == Behaviour.FENCED:
        return f"```json\n{text}\n```"
    if behaviour == Behaviour.PROSE:
        return f"Here is the RecoveryPatchSet you asked for:\n{text}\nLet me know if you need more."
    if behaviour == Behaviour.NON_JSON:
        return "I could not settle these fields."
    if behaviour == Behaviour.OVERSIZE:
        return text + " " * config.oversize_chars
    return text


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "SuperAgentStub/1"
    state: _State  # set on the subclass made per server

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

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: str) -> None:
        self._send_json(status, {"error": {"code": code}})

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
        cookie = SimpleCookie()
        try:
            cookie.load(self.headers.get("Cookie", ""))
        except Exception:
            cookie = SimpleCookie()
        header = self.headers.get("X-CSRF-Token", "")
        morsel = cookie.get("csrf_token")
        if len(header) < 16 or morsel is None or morsel.value != header:
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
        parts = url.path.strip("/").split("/")
        if url.path == "/_stats":
            with self.state.lock:
                self._send_json(200, asdict(self.state.stats))
            return
        if len(parts) == 4 and parts[:3] == ["open", "v1", "runs"]:
            self.state.bump("run_status")
            if self._authorized():
                self._run_status(parts[3])
            return
        if len(parts) == 5 and parts[:3] == ["open", "v1", "runs"] and parts[4] == "events":
            self.state.bump("events_replays")
            if self._authorized():
                after = parse_qs(url.query).get("after", ["0"])[0]
                self._replay(parts[3], int(after) if after.isdigit() else 0)
            return
        self._error(404, "not_found")

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
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
            self.state.bump("sessions")
            if self._authorized():
                self._create_session(body)
            return
        if len(parts) == 6 and parts[:3] == ["open", "v1", "sessions"] and parts[4:] == ["messages", "stream"]:
            self.state.bump("streams")
            if body.get("include_trace"):
                self.state.bump("include_trace_requests")
            if self._authorized():
                self._stream(parts[3], body)
            return
        if len(parts) == 5 and parts[:3] == ["open", "v1", "runs"] and parts[4] == "cancel":
            self.state.bump("cancels")
            if self._authorized():
                self._cancel(parts[3])
            return
        self._error(404, "not_found")

    # --- endpoints -------------------------------------------------------------------------

    def _create_session(self, body: dict[str, Any]) -> None:
        subject = body.get("external_subject_id")
        if not isinstance(subject, str) or len(subject) != 64:
            self._error(400, "invalid_external_subject_id")
            return
        session_id = self.state.next_id("ses")
        with self.state.lock:
            self.state.sessions[session_id] = subject
        self._send_json(200, {"session_id": session_id})

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
            answer = _answer_text(content, config)
        except ValueError:
            self._error(400, "invalid_message")
            return
        run = _Run(run_id=state.next_id("run"), session_id=session_id, events=[])
        events: list[tuple[str, dict[str, Any]]] = [("run.started", {"run_id": run.run_id})]
        if config.behaviour == Behaviour.RUN_FAILED:
            events += [("error", {"code": "run_failed"}), ("end", {})]
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
        with state.lock:
            state.runs[run.run_id] = run
        cut = config.behaviour in (Behaviour.CUT_REPLAYABLE, Behaviour.CUT_UNRECOVERABLE)
        self._write_events(run, run.events, config, cut_after=config.cut_after if cut else None)

    def _replay(self, run_id: str, after: int) -> None:
        state = self.state
        run = state.runs.get(run_id)
        if run is None:
            self._error(404, "run_not_found")
            return
        if state.config.behaviour == Behaviour.CUT_UNRECOVERABLE:
            self._error(503, "events_unavailable")
            return
        self._write_events(run, [e for e in run.events if e[0] > after], replace(state.config, event_delay=0.0))

    def _run_status(self, run_id: str) -> None:
        run = self.state.runs.get(run_id)
        if run is None:
            self._error(404, "run_not_found")
            return
        self._send_json(
            200,
            {
                "run_id": run.run_id,
                "status": run.status,
                "metadata": {
                    "resolved_profile_id": "prof_fixed_channel_recovery",
                    "resolved_profile_version": "7",
                },
                "model": "superagent-stub-1",
                "usage": {"prompt_tokens": 812, "completion_tokens": 164, "total_tokens": 976},
            },
        )

    def _cancel(self, run_id: str) -> None:
        run = self.state.runs.get(run_id)
        if run is None:
            self._error(404, "run_not_found")
            return
        with self.state.lock:
            self.state.cancelled_runs.append(run_id)
            if run.status == "running":
                run.status = "cancelled"
        run.cancelled.set()
        self._send_json(200, {"run_id": run_id, "status": run.status})

    # --- SSE writing -----------------------------------------------------------------------

    def _write_events(
        self,
        run: _Run,
        events: list[tuple[int, str, dict[str, Any]]],
        config: StubConfig,
        cut_after: int | None = None,
    ) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        if config.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        try:
            for count, (event_id, name, data) in enumerate(events):
                frame = f"id: {event_id}\nevent: {name}\ndata: {canonical_json(data)}\n\n".encode()
                if cut_after is not None and count >= cut_after:
                    if config.cut_mid_event:
                        self._write(frame[: len(frame) // 2], config.chunked)
                    self._cut()
                    return
                slow = name == "message.final" and config.behaviour == Behaviour.SLOW
                if slow and not self._stall(run, config):
                    return
                if config.event_delay:
                    self.state.stopping.wait(config.event_delay)
                if name == "end":  # the run is over before the client can ask for its status
                    with self.state.lock:
                        if run.status == "running":
                            run.status = run.final_status
                self._write(frame, config.chunked)
            if config.chunked:
                self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client went away (deadline watchdog): nothing more to send
            self.close_connection = True

    def _stall(self, run: _Run, config: StubConfig) -> bool:
        """Wait before the final answer; False when the run was cancelled or the server stops."""
        waited = 0.0
        step = 0.2 if config.drip else config.stall_seconds
        while waited < config.stall_seconds:
            if run.cancelled.wait(min(step, config.stall_seconds - waited)) or self.state.stopping.is_set():
                self.close_connection = True
                return False
            waited += step
            if config.drip:
                self._write(b": keepalive\n\n", config.chunked)
        return True

    def _write(self, data: bytes, chunked: bool) -> None:
        if chunked:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        else:
            self.wfile.write(data)
        self.wfile.flush()

    def _cut(self) -> None:
        """Drop the connection mid-stream (no terminating chunk)."""
        self.wfile.flush()
        self.close_connection = True
        try:
            self.connection.shutdown(2)
        except OSError:
            pass


class SuperAgentStub:
    """The stand-in server, started and stopped in-process (``with SuperAgentStub() as stub``)."""

    def __init__(
        self,
        *,
        api_key: str = DEFAULT_API_KEY,
        host: str = "127.0.0.1",
        port: int = 0,
        config: StubConfig | None = None,
    ) -> None:
        self._state = _State(api_key, config or StubConfig())
        handler = type("_BoundHandler", (_Handler,), {"state": self._state})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

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
