"""SuperAgent Open API client for the parsing agent (requests + sseclient-py).

One call (``recover``) under one Deadline:

1. ``POST /open/v1/sessions`` {external_subject_id} -> session_id
2. ``POST /open/v1/sessions/{id}/messages/stream`` {content, idempotency_key} -> SSE
   (``run.started`` {run_id}, ``message.delta``, core ``message.final`` {content}, top-level
   ``end``; ``error`` {code} fails the call). ``include_trace`` is sent only when configured.
3. On a broken stream: ``GET /open/v1/runs/{run_id}/events?after=ID`` up to
   ``sse_recovery_max_attempts`` times.
4. ``GET /open/v1/runs/{run_id}``: status ``success`` is the authority; it supplies the resolved
   profile, the model and the token usage.
5. At the deadline: the stream is cut by the watchdog, then ``POST /open/v1/runs/{id}/cancel``.

Every request carries ``Authorization: Bearer <key>`` and a fresh CSRF double-submit token (the
same random value as cookie ``csrf_token`` and header ``X-CSRF-Token``). Success needs the
explicit ``end`` event and a complete ``message.final``; "the stream ended" is never success,
and an event whose data is not a complete JSON object (a partial event at a cut) is not used.

The client is built from the parsing agent's OWN settings only (``client_for``): it cannot see
another agent's key.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import requests
import urllib3.exceptions
from sseclient import SSEClient

from recovery.field.deadline import Deadline, Watchdog, response_socket
from recovery.field.errors import (
    DeadlineExceeded,
    FieldRecoveryError,
    ProviderOutputInvalid,
    ProviderRejected,
    ProviderUnavailable,
)
from recovery.field.logs import get_logger, log_event
from settings import FieldRecoverySettings, OpenApiSettings

log = get_logger("client")

READ_CHUNK_BYTES = 8192
#: The cancel is sent after the deadline (cancel grace is outside it) with this bound.
CANCEL_TIMEOUT_SECONDS = 5.0
#: First pause between SSE recovery attempts; doubles, with jitter, capped by the time left.
RECOVERY_BACKOFF_SECONDS = 0.05
_SAFE_TOKEN = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclass
class CallProgress:
    """What the call learned so far; kept for the audit record even when the call fails."""

    session_id: str | None = None
    run_id: str | None = None
    #: HTTP requests sent to the provider (0: the provider was never called).
    requests: int = 0
    streams: int = 0
    sse_recoveries: int = 0
    cancel_sent: bool = False

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


class _StreamBroken(Exception):
    """The SSE stream stopped before ``end`` (recoverable through the events endpoint)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


#: How a stream read fails when the stream is cut (recoverable through the events endpoint).
_BROKEN = (_StreamBroken, requests.RequestException, urllib3.exceptions.HTTPError, OSError)


@dataclass
class _StreamState:
    last_event_id: str | None = None
    final: str | None = None
    ended: bool = False
    bytes_read: int = 0


def _safe(value: Any, default: str) -> str:
    return value if isinstance(value, str) and _SAFE_TOKEN.match(value) else default


def _opt_str(value: Any) -> str | None:
    return value[:128] if isinstance(value, str) and value else None


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _transport_code(exc: BaseException) -> str:
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
    def __init__(self, settings: OpenApiSettings, *, max_response_chars: int) -> None:
        self._base = settings.base_url.rstrip("/")
        self._key = settings.api_key
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
        self, content: str, *, idempotency_key: str, subject_id: str, deadline: Deadline, progress: CallProgress
    ) -> ProviderAnswer:
        """Send the message, wait for the complete successful answer within ``deadline``.

        Raises DeadlineExceeded (after cutting the stream and sending the run cancel),
        ProviderRejected, ProviderUnavailable or ProviderOutputInvalid; never returns a
        partial answer.
        """
        try:
            with requests.Session() as http, Watchdog(deadline) as watchdog:
                try:
                    return self._call(http, watchdog, deadline, progress, content, idempotency_key, subject_id)
                except DeadlineExceeded:
                    raise
                except FieldRecoveryError:
                    if watchdog.fired.is_set():
                        raise DeadlineExceeded() from None
                    raise
                except (requests.RequestException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                    if watchdog.fired.is_set() or deadline.expired:
                        raise DeadlineExceeded() from None
                    raise ProviderUnavailable(
                        f"transport error ({type(exc).__name__})", code=_transport_code(exc)
                    ) from None
                except Exception:
                    # NOTE: the watchdog closes the response under the reading thread; http.client
                    # may then fail with any error (e.g. AttributeError on its vanished fp).
                    if watchdog.fired.is_set():
                        raise DeadlineExceeded() from None
                    raise
        except DeadlineExceeded:
            if progress.run_id is not None:
                progress.cancel_sent = self.cancel(progress.run_id)
            raise

    def cancel(self, run_id: str) -> bool:
        """POST the run cancel (best effort, bounded by CANCEL_TIMEOUT_SECONDS)."""
        token = secrets.token_urlsafe(32)
        try:
            with requests.Session() as http:
                response = http.post(
                    f"{self._base}/open/v1/runs/{run_id}/cancel",
                    headers=self._headers(token, "application/json"),
                    cookies={"csrf_token": token},
                    timeout=(min(self._connect_timeout, CANCEL_TIMEOUT_SECONDS), CANCEL_TIMEOUT_SECONDS),
                    allow_redirects=False,
                )
                ok = response.status_code in (200, 202)
                status: int | str = response.status_code
        except requests.RequestException as exc:
            ok, status = False, _transport_code(exc)
        log_event(log, "provider_cancel", run_id=run_id, ok=ok, status=status)
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
        if not isinstance(session_id, str) or not _SAFE_TOKEN.match(session_id):
            raise ProviderUnavailable("the session response has no session_id", code="bad_response")
        progress.session_id = session_id

        body: dict[str, Any] = {"content": content, "idempotency_key": idempotency_key}
        if self._include_trace:
            body["include_trace"] = True
        state = _StreamState()
        progress.streams += 1
        stream = self._send(
            http, watchdog, deadline, progress, "POST", f"/open/v1/sessions/{session_id}/messages/stream", body=body
        )
        try:
            self._read_stream(stream, state, deadline, progress)
        except _BROKEN as exc:
            self._note_broken(exc, watchdog, deadline, progress, state)
        finally:
            stream.close()
        self._recover_stream(http, watchdog, deadline, progress, state)
        if state.final is None:
            raise ProviderUnavailable("the stream ended without message.final", code="sse_no_final")
        assert progress.run_id is not None
        run = self._json(self._send(http, watchdog, deadline, progress, "GET", f"/open/v1/runs/{progress.run_id}"))
        status = run.get("status")
        if status != "success":
            raise ProviderUnavailable("the run did not succeed", code=f"run_status_{_safe(status, 'unknown')}")
        metadata = _dict(run.get("metadata"))
        usage = _dict(run.get("usage"))
        return ProviderAnswer(
            content=state.final,
            session_id=session_id,
            run_id=progress.run_id,
            resolved_profile_id=_opt_str(metadata.get("resolved_profile_id")),
            resolved_profile_version=_opt_str(metadata.get("resolved_profile_version")),
            model=_opt_str(run.get("model")),
            prompt_tokens=_opt_int(usage.get("prompt_tokens")),
            completion_tokens=_opt_int(usage.get("completion_tokens")),
            total_tokens=_opt_int(usage.get("total_tokens")),
        )

    def _recover_stream(
        self,
        http: requests.Session,
        watchdog: Watchdog,
        deadline: Deadline,
        progress: CallProgress,
        state: _StreamState,
    ) -> None:
        """Replay the run's events after the last complete one until ``end`` (bounded)."""
        attempts = 0
        while not state.ended:
            if progress.run_id is None:
                raise ProviderUnavailable("the stream broke before the run started", code="sse_broken_before_run")
            if attempts >= self._max_attempts:
                raise ProviderUnavailable("SSE recovery attempts exhausted", code="sse_recovery_exhausted")
            if attempts:
                pause = RECOVERY_BACKOFF_SECONDS * 2 ** (attempts - 1) * random.uniform(0.5, 1.0)
                time.sleep(min(pause, deadline.remaining()))
            attempts += 1
            progress.sse_recoveries += 1
            deadline.check()
            log_event(log, "sse_recovery", run_id=progress.run_id, attempt=attempts, after=state.last_event_id)
            params = {"after": state.last_event_id} if state.last_event_id is not None else None
            try:
                replay = self._send(
                    http,
                    watchdog,
                    deadline,
                    progress,
                    "GET",
                    f"/open/v1/runs/{progress.run_id}/events",
                    params=params,
                    accept="text/event-stream",
                    transient_5xx=True,
                )
            except (_StreamBroken, requests.RequestException) as exc:
                if watchdog.fired.is_set() or deadline.expired:
                    raise DeadlineExceeded() from None
                code = exc.code if isinstance(exc, _StreamBroken) else _transport_code(exc)
                log_event(log, "sse_recovery_failed", run_id=progress.run_id, attempt=attempts, code=code)
                continue
            try:
                self._read_stream(replay, state, deadline, progress)
            except _BROKEN as exc:
                self._note_broken(exc, watchdog, deadline, progress, state)
            finally:
                replay.close()

    @staticmethod
    def _note_broken(
        exc: Exception, watchdog: Watchdog, deadline: Deadline, progress: CallProgress, state: _StreamState
    ) -> None:
        """A stream broke: the deadline's doing (raise), or a cut to recover from (log)."""
        if watchdog.fired.is_set() or deadline.expired:
            raise DeadlineExceeded() from None
        code = exc.code if isinstance(exc, _StreamBroken) else _transport_code(exc)
        log_event(log, "sse_broken", run_id=progress.run_id, code=code, last_event_id=state.last_event_id)

    # --- HTTP plumbing ---------------------------------------------------------------------

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
        progress.requests += 1
        token = secrets.token_urlsafe(32)
        streaming = path.endswith("/stream") or accept == "text/event-stream"
        response = http.request(
            method,
            self._base + path,
            headers=self._headers(token, accept or ("text/event-stream" if streaming else "application/json")),
            cookies={"csrf_token": token},
            json=body,
            params=params,
            stream=True,
            timeout=(deadline.cap(self._connect_timeout), deadline.cap(deadline.seconds)),
            allow_redirects=False,
        )
        watchdog.watch(response)
        if response.status_code != 200:
            self._raise_for_status(response, transient_5xx)
        if streaming and not response.headers.get("Content-Type", "").startswith("text/event-stream"):
            response.close()
            raise ProviderUnavailable("the stream response is not text/event-stream", code="sse_content_type")
        return response

    def _raise_for_status(self, response: requests.Response, transient_5xx: bool) -> None:
        status = response.status_code
        try:
            payload = _json_object(response.content[:4096].decode("utf-8", "replace")) or {}
        finally:
            response.close()
        error = _dict(payload.get("error"))
        provider_code = _safe(error.get("code"), "")
        if provider_code == "open_agent_trace_disabled":
            raise ProviderRejected("the external application refuses include_trace", code=provider_code)
        if status >= 500:
            if transient_5xx:
                raise _StreamBroken(f"http_{status}")
            raise ProviderUnavailable(f"the provider answered HTTP {status}", code=f"http_{status}")
        raise ProviderRejected(f"the provider answered HTTP {status}", code=f"http_{status}")

    def _json(self, response: requests.Response) -> dict[str, Any]:
        try:
            obj = _json_object(response.content.decode("utf-8", "replace"))
        finally:
            response.close()
        if obj is None:
            raise ProviderUnavailable("the provider answered something that is not a JSON object", code="bad_response")
        return obj

    def _read_stream(
        self, response: requests.Response, state: _StreamState, deadline: Deadline, progress: CallProgress
    ) -> None:
        """Consume SSE events into ``state`` until ``end``; raise _StreamBroken before it."""
        for event in SSEClient(self._chunks(response, state, deadline)).events():
            payload = _json_object(event.data)
            if payload is None:  # a partial event at a cut: never used, never acknowledged
                raise _StreamBroken("sse_malformed")
            name = event.event
            if name == "run.started":
                run_id = payload.get("run_id")
                if not isinstance(run_id, str) or not _SAFE_TOKEN.match(run_id):
                    raise ProviderUnavailable("run.started has no run_id", code="bad_response")
                progress.run_id = run_id
            elif name == "message.final":
                final = payload.get("content")
                if not isinstance(final, str):
                    raise ProviderUnavailable("message.final has no content", code="bad_response")
                state.final = final
            elif name == "error":
                raise ProviderUnavailable(
                    "the run reported an error", code=_safe(payload.get("code"), "provider_error")
                )
            elif name == "end":
                state.ended = True
                return
            if event.id:
                state.last_event_id = event.id
        raise _StreamBroken("sse_no_end")

    def _chunks(self, response: requests.Response, state: _StreamState, deadline: Deadline) -> Iterator[bytes]:
        """Body bytes as they arrive; each read's socket timeout is capped at the time left."""
        raw = response.raw
        while True:
            deadline.check()
            sock = response_socket(response)
            if sock is not None:
                sock.settimeout(deadline.cap(deadline.seconds))
            data = raw.read1(READ_CHUNK_BYTES)
            if not data:
                return
            state.bytes_read += len(data)
            if state.bytes_read > self._byte_budget:
                raise ProviderOutputInvalid("the stream exceeds the response budget", code="response_too_large")
            yield data
