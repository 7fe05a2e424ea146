"""SuperAgent Open API client for the parsing agent (requests; SSE framing and parsing in sse.py).

One call (``recover``) under one Deadline:

1. ``POST /open/v1/sessions`` {external_subject_id} -> session_id
2. ``POST /open/v1/sessions/{id}/messages/stream`` {content, idempotency_key} -> SSE
   (``run.started`` {run_id}, ``message.delta``, core ``message.final`` {content}, top-level
   ``end``; ``error`` {code} fails the call). ``include_trace`` is sent only when configured.
3. On a broken stream: ``GET /open/v1/runs/{run_id}/events?after=ID``. A replay that fails
   (transport error, 5xx, a cut) uses up one of ``sse_recovery_max_attempts``; a replay that
   ends cleanly before ``end`` while the run is still in progress does not: such a run is
   followed until it ends or the deadline comes.
4. ``GET /open/v1/runs/{run_id}``: status ``success`` is the authority; it supplies the resolved
   profile, the model and the token usage.
5. On any failure after the run started (the deadline, a lost lease, a broken or oversized
   stream): ``POST /open/v1/runs/{id}/cancel``. When the call stops after the message was sent
   but before the run id is known, ``POST /open/v1/sessions/{id}/cancel`` instead (best effort:
   a platform without it answers 404, which is logged). The cancel has its own short bound.

The deadline bounds the whole call: every socket is watched from the moment it connects
(transport.py), so a peer that drips its headers is cut like one that stalls its body. Every
request carries ``Authorization: Bearer <key>`` and a fresh CSRF double-submit token (the same
random value as cookie ``csrf_token`` and header ``X-CSRF-Token``; the session never keeps a
platform's own ``csrf_token`` cookie, so exactly one goes out). Every request asks for
``Accept-Encoding: identity``; a body compressed anyway (a proxy) is decoded, capped in decoded
bytes (a compression bomb is refused, not inflated).

Success needs the explicit ``end`` event and a complete ``message.final``; "the stream ended" is
never success. Only the event types used here (``run.started``, ``message.final``, ``error``,
``end``) must carry a JSON object; others (``message.delta``, ``heartbeat`` …) are skipped. An
event not terminated by its blank line when the body ends is dropped and its id not
acknowledged, so a replay sends it again.

The client is built from the parsing agent's OWN settings only (``client_for``): it cannot see
another agent's key.
"""

from __future__ import annotations

import http.client
import logging
import random
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests
import urllib3.exceptions

from fieldrecovery.deadline import Deadline, StopSignal, Watchdog
from fieldrecovery.errors import (
    DeadlineExceeded,
    FieldRecoveryError,
    InvocationLost,
    ProviderOutputInvalid,
    ProviderRejected,
    ProviderUnavailable,
)
from fieldrecovery.schemas import INT32_MAX, storable_text
from fieldrecovery.sse import BROKEN, StreamBroken, StreamState, json_object, read_events
from fieldrecovery.transport import CSRF_COOKIE, Resolver, read_capped, watched_session
from logfmt import log_event
from settings import FieldRecoverySettings, OpenApiSettings

log = logging.getLogger(__name__)

#: The cancel is sent after the deadline (cancel grace is outside it) with this bound.
CANCEL_TIMEOUT_SECONDS = 5.0
#: First pause between SSE recovery attempts; doubles, with jitter, capped by the time left.
RECOVERY_BACKOFF_SECONDS = 0.05
#: Longest pause between two replays of a run that is still in progress.
RECOVERY_MAX_PAUSE_SECONDS = 1.0
#: Run statuses that mean "not over yet": a replay without ``end`` is followed, not a failure.
RUN_IN_PROGRESS = frozenset({"running", "queued", "pending", "in_progress", "created"})
#: Decoded bytes read of an error body (only its error code is used).
ERROR_BODY_BYTES = 4096
#: Decoded bytes allowed in a JSON answer (session, run status): far above any real one.
JSON_BODY_BYTES = 1 << 20
#: A peer's id or code we store, log or put in a URL path. ``\Z``, not ``$``: ``$`` also matches
#: before a final newline, so ``"run_1\n"`` would pass.
_SAFE_TOKEN = re.compile(r"\A[A-Za-z0-9_.:-]{1,64}\Z")
#: Characters of the configured key that, found in a row in a peer's string, mean it echoed the key.
KEY_RUN_CHARS = 8
#: What a peer's string that carries the key is replaced with in a log line.
REDACTED = "redacted"


class KeyGuard:
    """Finds the configured key, or any KEY_RUN_CHARS-character run of it, in a peer's string.

    A peer (or a proxy) may echo the Bearer key in an error code, a run status, an id or an
    answer: such a string is never stored, logged or returned as it is. Linear in the string:
    every run of the key is in one set, and each window of the string is looked up once.
    """

    def __init__(self, key: str) -> None:
        self._key = key
        width = min(KEY_RUN_CHARS, len(key))
        self._width = width
        self._runs = frozenset(key[i : i + width] for i in range(len(key) - width + 1)) if key else frozenset()

    def carries(self, text: str) -> bool:
        if not self._runs:
            return False
        width = self._width
        return any(text[i : i + width] in self._runs for i in range(len(text) - width + 1))


#: ``on_run(session_id, run_id)``: called once the run id is known (the owner records it).
RunListener = Callable[[str, str], None]


@dataclass
class CallProgress:
    """What the call learned so far; kept for the audit record even when the call fails."""

    session_id: str | None = None
    run_id: str | None = None
    #: HTTP requests sent to the provider (0: the provider was never called).
    requests: int = 0
    streams: int = 0
    #: The message stream was answered with an HTTP error: no run was started by it.
    stream_refused: bool = False
    #: The run is known to be over (``end`` seen or a terminal run status): nothing to cancel.
    run_over: bool = False
    sse_recoveries: int = 0
    cancel_sent: bool = False
    #: Told the run id as soon as ``run.started`` names it (so a dead owner's run can be cancelled).
    on_run: RunListener | None = None

    @property
    def called(self) -> int:
        """1 when at least one request was sent to the provider, else 0 (one call, however many requests)."""
        return 1 if self.requests else 0


@dataclass(frozen=True)
class ProviderAnswer:
    content: str
    session_id: str
    run_id: str
    resolved_profile_id: str | None
    resolved_profile_version: str | None
    model: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None


def is_token(value: Any) -> bool:
    """A peer's id or code we may put in a URL path: the safe-token alphabet, not dots only
    (``.`` and ``..`` are path segments that move the request elsewhere)."""
    return isinstance(value, str) and bool(_SAFE_TOKEN.match(value)) and bool(value.strip("."))


def _safe(value: Any, default: str) -> str:
    """``value`` when it is a token (``is_token``), else ``default``; the key is checked by the client."""
    return value if is_token(value) else default


def segment(value: str) -> str:
    """One URL path segment: every character but unreserved ones percent-encoded."""
    return quote(value, safe="")


def _opt_int(value: Any) -> int | None:
    """A token count for the audit record (an ``integer`` column), or None when out of range."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT32_MAX
    return value if ok else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _malformed_reply(exc: BaseException) -> bool:
    """The peer answered, but not with HTTP we read: too many headers, an overlong line, a bad
    status line. A peer that closed before answering (RemoteDisconnected) is not one."""
    seen: list[BaseException] = [exc]
    for current in seen:
        if len(seen) > 16:
            break
        if isinstance(current, http.client.HTTPException) and not isinstance(current, http.client.RemoteDisconnected):
            if isinstance(current, http.client.LineTooLong | http.client.BadStatusLine):
                return True
            if "headers" in str(current) or "informational" in str(current):
                return True
        for inner in (*current.args, current.__cause__, current.__context__):
            if isinstance(inner, BaseException) and inner not in seen:
                seen.append(inner)
    return False


def _transport_code(exc: BaseException) -> str:
    if _malformed_reply(exc):
        return "bad_response"
    if isinstance(exc, requests.ConnectTimeout):
        return "connect_timeout"
    if isinstance(exc, requests.exceptions.SSLError):
        return "tls"
    if isinstance(exc, requests.exceptions.ChunkedEncodingError | urllib3.exceptions.ProtocolError):
        return "stream_broken"
    if isinstance(exc, requests.Timeout | urllib3.exceptions.ReadTimeoutError | TimeoutError):
        return "read_timeout"
    if isinstance(exc, requests.ConnectionError):
        return "connect"
    return "transport"


def client_for(settings: FieldRecoverySettings) -> OpenApiClient:
    """The parsing agent's client, from booking.field-recovery.* only (credential isolation)."""
    return OpenApiClient(settings.open_api, max_response_chars=settings.max_response_chars)


class OpenApiClient:
    def __init__(self, settings: OpenApiSettings, *, max_response_chars: int, resolver: Resolver | None = None) -> None:
        """``resolver`` replaces ``socket.getaddrinfo`` for the platform's (or the proxy's) name."""
        self._base = settings.base_url.rstrip("/")
        self._proxy = settings.proxy.get_secret_value()
        self._ca_bundle = settings.ca_bundle
        self._resolver = resolver
        self._key = settings.api_key.get_secret_value()
        self._guard = KeyGuard(self._key)
        self._connect_timeout = settings.connect_timeout
        self._max_attempts = settings.sse_recovery_max_attempts
        self._include_trace = settings.include_trace
        # The final answer is JSON-escaped inside an event and may be streamed twice (deltas):
        # a stream much larger than that is refused before it exhausts memory.
        self._byte_budget = 8 * max_response_chars + 65536

    def __repr__(self) -> str:  # never show the key
        return f"OpenApiClient(base_url={self._base!r})"

    # --- public ----------------------------------------------------------------------------

    def recover(
        self,
        content: str,
        *,
        idempotency_key: str,
        subject_id: str,
        deadline: Deadline,
        progress: CallProgress,
        stop: StopSignal | None = None,
    ) -> ProviderAnswer:
        """Send the message, wait for the complete successful answer within ``deadline``.

        ``stop`` is set by the owner's lease keeper when the invocation was taken from it: the
        call is cut at once and raises InvocationLost. Raises DeadlineExceeded, InvocationLost,
        ProviderRejected, ProviderUnavailable or ProviderOutputInvalid; never returns a partial
        answer. On every failure after the message was sent the run is cancelled (module doc).
        """
        try:
            with Watchdog(deadline, stop) as watchdog, self._session(watchdog) as http:
                try:
                    return self._call(http, watchdog, deadline, progress, content, idempotency_key, subject_id)
                except FieldRecoveryError as exc:
                    raise self._cause(watchdog, deadline, exc) from None
                except (requests.RequestException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                    error = ProviderUnavailable(f"transport error ({type(exc).__name__})", code=_transport_code(exc))
                    raise self._cause(watchdog, deadline, error) from None
                except Exception:
                    # NOTE: the watchdog closes the response under the reading thread; http.client
                    # may then fail with any error (e.g. AttributeError on its vanished fp).
                    if watchdog.fired.is_set():
                        raise self._cause(watchdog, deadline, DeadlineExceeded()) from None
                    raise
        except FieldRecoveryError:
            self._cancel_after_failure(progress)
            raise

    def cancel(self, run_id: str) -> bool:
        """POST the run cancel (best effort, bounded in total by CANCEL_TIMEOUT_SECONDS)."""
        return self._post_cancel(
            f"/open/v1/runs/{segment(run_id)}/cancel", "provider_cancel", run_id=self._loggable(run_id)
        )

    def cancel_session(self, session_id: str) -> bool:
        """POST the session cancel: stops the session's active run whose id was never learned."""
        return self._post_cancel(
            f"/open/v1/sessions/{segment(session_id)}/cancel",
            "provider_session_cancel",
            session_id=self._loggable(session_id),
        )

    # --- what comes from the peer ----------------------------------------------------------

    def _token(self, value: Any, default: str) -> str:
        """A peer's code or status as a safe token, or ``default`` (unsafe, or it carries the key)."""
        token = _safe(value, default)
        return default if self._guard.carries(token) else token

    def _opt_str(self, value: Any) -> str | None:
        """A run-status string for the audit record, or None when it could not be stored."""
        if not isinstance(value, str) or not value or not storable_text(value):
            return None
        return None if self._guard.carries(value) else value[:128]

    def _loggable(self, value: str | None) -> str | None:
        """A peer's id as it may appear in a log line: a safe token that does not carry the key."""
        return None if value is None else self._token(value, REDACTED)

    # --- failure handling ------------------------------------------------------------------

    @staticmethod
    def _cause(watchdog: Watchdog, deadline: Deadline, error: FieldRecoveryError) -> FieldRecoveryError:
        """The error to raise: a cut by the watchdog is the deadline's or the lost lease's doing."""
        if watchdog.stopped:
            return InvocationLost("the owner lost the invocation's lease; the call was stopped")
        if isinstance(error, DeadlineExceeded) or watchdog.fired.is_set() or deadline.expired:
            return DeadlineExceeded()
        return error

    def _cancel_after_failure(self, progress: CallProgress) -> None:
        if progress.run_over:
            return
        if progress.run_id is not None:
            progress.cancel_sent = self.cancel(progress.run_id)
        elif progress.session_id is not None and progress.streams and not progress.stream_refused:
            # NOTE: the message went out but its run.started never came back (headers or first
            # event still pending): a run may exist that we cannot name.
            progress.cancel_sent = self.cancel_session(progress.session_id)

    def _post_cancel(self, path: str, event: str, **ids: Any) -> bool:
        token = secrets.token_urlsafe(32)
        deadline = Deadline(CANCEL_TIMEOUT_SECONDS)
        status: int | str
        try:
            with Watchdog(deadline) as watchdog, self._session(watchdog) as http:
                response = http.post(
                    self._base + path,
                    headers=self._headers(token, "application/json"),
                    cookies={CSRF_COOKIE: token},
                    timeout=(deadline.cap(self._connect_timeout), deadline.cap(CANCEL_TIMEOUT_SECONDS)),
                    allow_redirects=False,
                )
                response.close()
                ok = 200 <= response.status_code < 300
                status = response.status_code
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            ok, status = False, _transport_code(exc)
        log_event(log, event, ok=ok, status=status, **ids)
        return ok

    # --- the call --------------------------------------------------------------------------

    def _call(
        self,
        http: requests.Session,
        watchdog: Watchdog,
        deadline: Deadline,
        progress: CallProgress,
        content: str,
        idempotency_key: str,
        subject_id: str,
    ) -> ProviderAnswer:
        session = self._json(
            self._send(
                http,
                watchdog,
                deadline,
                progress,
                "POST",
                "/open/v1/sessions",
                body={"external_subject_id": subject_id},
            )
        )
        session_id = session.get("session_id")
        if not isinstance(session_id, str) or self._token(session_id, "") != session_id:
            raise ProviderUnavailable("the session response has no session_id", code="bad_response")
        progress.session_id = session_id

        body: dict[str, Any] = {"content": content, "idempotency_key": idempotency_key}
        if self._include_trace:
            body["include_trace"] = True
        state = StreamState()
        progress.streams += 1
        try:
            stream = self._send(
                http,
                watchdog,
                deadline,
                progress,
                "POST",
                f"/open/v1/sessions/{segment(session_id)}/messages/stream",
                body=body,
            )
        except (ProviderRejected, ProviderUnavailable) as exc:
            # Only a refusal (4xx) says no run was started; after anything else (a 5xx from a
            # proxy, a reply we cannot read) a run may exist: the failure cancels the session's.
            progress.stream_refused = exc.code.startswith("http_4") or exc.code == "open_agent_trace_disabled"
            raise
        try:
            self._read_stream(stream, state, deadline, progress)
        except BROKEN as exc:
            self._note_broken(exc, watchdog, deadline, progress, state)
        finally:
            stream.close()
        self._recover_stream(http, watchdog, deadline, progress, state)
        if state.final is None:
            raise ProviderUnavailable("the stream ended without message.final", code="sse_no_final")
        assert progress.run_id is not None
        run = self._run_status(http, watchdog, deadline, progress)
        status = run.get("status")
        if status != "success":
            raise ProviderUnavailable("the run did not succeed", code=f"run_status_{self._token(status, 'unknown')}")
        metadata = _dict(run.get("metadata"))
        usage = _dict(run.get("usage"))
        return ProviderAnswer(
            content=state.final,
            session_id=session_id,
            run_id=progress.run_id,
            resolved_profile_id=self._opt_str(metadata.get("resolved_profile_id")),
            resolved_profile_version=self._opt_str(metadata.get("resolved_profile_version")),
            model=self._opt_str(run.get("model")),
            prompt_tokens=_opt_int(usage.get("prompt_tokens")),
            completion_tokens=_opt_int(usage.get("completion_tokens")),
            total_tokens=_opt_int(usage.get("total_tokens")),
        )

    def _run_status(
        self, http: requests.Session, watchdog: Watchdog, deadline: Deadline, progress: CallProgress
    ) -> dict[str, Any]:
        assert progress.run_id is not None
        path = f"/open/v1/runs/{segment(progress.run_id)}"
        run = self._json(self._send(http, watchdog, deadline, progress, "GET", path))
        if run.get("status") not in RUN_IN_PROGRESS:
            progress.run_over = True
        return run

    def _recover_stream(
        self,
        http: requests.Session,
        watchdog: Watchdog,
        deadline: Deadline,
        progress: CallProgress,
        state: StreamState,
    ) -> None:
        """Replay the run's events after the last complete one until ``end`` (module doc, step 3)."""
        failures = 0
        replays = 0
        while not state.ended:
            if progress.run_id is None:
                raise ProviderUnavailable("the stream broke before the run started", code="sse_broken_before_run")
            if failures >= self._max_attempts:
                raise ProviderUnavailable("SSE recovery attempts exhausted", code="sse_recovery_exhausted")
            if replays:
                pause = min(RECOVERY_BACKOFF_SECONDS * 2 ** (replays - 1), RECOVERY_MAX_PAUSE_SECONDS)
                time.sleep(min(pause * random.uniform(0.5, 1.0), deadline.remaining()))
            replays += 1
            progress.sse_recoveries += 1
            deadline.check()
            before = state.last_event_id
            log_event(log, "sse_recovery", run_id=progress.run_id, attempt=replays, after=self._loggable(before))
            params = {"after": before} if before is not None else None
            try:
                replay = self._send(
                    http,
                    watchdog,
                    deadline,
                    progress,
                    "GET",
                    f"/open/v1/runs/{segment(progress.run_id)}/events",
                    params=params,
                    accept="text/event-stream",
                    transient_5xx=True,
                )
            except (StreamBroken, requests.RequestException) as exc:
                if watchdog.fired.is_set() or deadline.expired:
                    raise DeadlineExceeded() from None
                code = exc.code if isinstance(exc, StreamBroken) else _transport_code(exc)
                log_event(log, "sse_recovery_failed", run_id=progress.run_id, attempt=replays, error_code=code)
                failures += 1
                continue
            try:
                self._read_stream(replay, state, deadline, progress)
            except BROKEN as exc:
                self._note_broken(exc, watchdog, deadline, progress, state)
                failures += 1
                continue
            finally:
                replay.close()
            if state.ended or state.last_event_id != before:
                continue  # done, or progress: the run is alive, follow it
            run = self._run_status(http, watchdog, deadline, progress)
            if run.get("status") in RUN_IN_PROGRESS:
                log_event(log, "sse_follow", run_id=progress.run_id, attempt=replays)
                continue
            failures += 1  # over, yet its events end without ``end``

    def _note_broken(
        self, exc: Exception, watchdog: Watchdog, deadline: Deadline, progress: CallProgress, state: StreamState
    ) -> None:
        """A stream broke: the watchdog's doing (raise), or a cut to recover from (log)."""
        if watchdog.fired.is_set() or deadline.expired:
            raise DeadlineExceeded() from None
        code = exc.code if isinstance(exc, StreamBroken) else _transport_code(exc)
        log_event(
            log,
            "sse_broken",
            run_id=progress.run_id,
            error_code=code,
            last_event_id=self._loggable(state.last_event_id),
        )

    # --- HTTP plumbing ---------------------------------------------------------------------

    def _session(self, watchdog: Watchdog) -> requests.Session:
        return watched_session(watchdog, proxy=self._proxy, ca_bundle=self._ca_bundle, resolver=self._resolver)

    def _headers(self, token: str, accept: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}", "X-CSRF-Token": token, "Accept": accept}

    def _send(
        self,
        http: requests.Session,
        watchdog: Watchdog,
        deadline: Deadline,
        progress: CallProgress,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        accept: str | None = None,
        transient_5xx: bool = False,
    ) -> requests.Response:
        """One request with a fresh CSRF token, timeouts capped at the time left, watched."""
        deadline.check()
        if watchdog.fired.is_set():
            raise DeadlineExceeded()  # mapped to InvocationLost by recover() when stopped
        progress.requests += 1
        token = secrets.token_urlsafe(32)
        streaming = path.endswith("/stream") or accept == "text/event-stream"
        headers = self._headers(token, accept or ("text/event-stream" if streaming else "application/json"))
        # Every body is read raw and capped in decoded bytes (sse._chunks, transport.read_capped);
        # a proxy that compresses anyway is decoded within that cap.
        headers["Accept-Encoding"] = "identity"
        response = http.request(
            method,
            self._base + path,
            headers=headers,
            cookies={CSRF_COOKIE: token},
            json=body,
            params=params,
            stream=True,
            timeout=(deadline.cap(self._connect_timeout), deadline.cap(deadline.seconds)),
            allow_redirects=False,
        )
        watchdog.watch(response)
        if not 200 <= response.status_code < 300:
            self._raise_for_status(response, transient_5xx)
        if streaming and not response.headers.get("Content-Type", "").startswith("text/event-stream"):
            response.close()
            raise ProviderUnavailable("the stream response is not text/event-stream", code="sse_content_type")
        return response

    def _raise_for_status(self, response: requests.Response, transient_5xx: bool) -> None:
        status = response.status_code
        try:
            body = read_capped(response, ERROR_BODY_BYTES)
        finally:
            response.close()
        payload = json_object(body.decode("utf-8", "replace")) if body is not None else None
        payload = payload or {}
        error = _dict(payload.get("error"))
        provider_code = self._token(error.get("code"), "")
        if provider_code == "open_agent_trace_disabled":
            raise ProviderRejected("the external application refuses include_trace", code=provider_code)
        if status >= 500:
            if transient_5xx:
                raise StreamBroken(f"http_{status}")
            raise ProviderUnavailable(f"the provider answered HTTP {status}", code=f"http_{status}")
        raise ProviderRejected(f"the provider answered HTTP {status}", code=f"http_{status}")

    def _read_stream(
        self, response: requests.Response, state: StreamState, deadline: Deadline, progress: CallProgress
    ) -> None:
        """Consume the events we use into ``state``; return at ``end`` or at a clean end of body."""
        for name, payload in read_events(response, state, deadline, byte_budget=self._byte_budget):
            self._consume(name, payload, state, progress)
            if state.ended:
                return

    def _consume(self, name: str, payload: dict[str, Any], state: StreamState, progress: CallProgress) -> None:
        if name == "run.started":
            run_id = payload.get("run_id")
            if not isinstance(run_id, str) or self._token(run_id, "") != run_id:
                raise ProviderUnavailable("run.started has no run_id", code="bad_response")
            progress.run_id = run_id
            if progress.on_run is not None and progress.session_id is not None:
                progress.on_run(progress.session_id, run_id)
        elif name == "message.final":
            final = payload.get("content")
            if not isinstance(final, str):
                raise ProviderUnavailable("message.final has no content", code="bad_response")
            if not storable_text(final):
                raise ProviderOutputInvalid("message.final has a lone surrogate or a NUL", code="output_bad_text")
            if self._guard.carries(final):
                raise ProviderOutputInvalid("message.final carries the key", code="output_carries_key")
            state.final = final
        elif name == "error":
            raise ProviderUnavailable(
                "the run reported an error", code=self._token(payload.get("code"), "provider_error")
            )
        elif name == "end":
            state.ended = True
            progress.run_over = True

    def _json(self, response: requests.Response) -> dict[str, Any]:
        try:
            body = read_capped(response, JSON_BODY_BYTES)
        finally:
            response.close()
        if body is None:
            raise ProviderUnavailable("the provider's JSON answer is too large", code="body_too_large")
        obj = json_object(body.decode("utf-8", "replace"))
        if obj is None:
            raise ProviderUnavailable("the provider answered something that is not a JSON object", code="bad_response")
        return obj
