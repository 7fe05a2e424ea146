"""OpenAI-compatible chat-completions client.

Every failure leaves this module as ``ModelUnavailable`` with one of these codes:
``connect`` (the endpoint could not be reached), ``timeout`` (no answer in time), ``http_4xx``,
``http_5xx``, ``bad_response`` (an answer that is not a chat completion). Exception messages name
the endpoint and the HTTP status; they never hold the API key or text of the request messages
(an error body that echoes the prompt is redacted before it is summarized).

Retries (as the official openai client does): HTTP 408, 409, 429, every 5xx, a connection
error (``connect``: the endpoint could not be reached, or dropped the connection), an answer
with ``x-should-retry: true`` whatever its status (``x-should-retry: false`` is never retried),
and an HTTP 200 whose body is an error object instead of a chat completion (``provider_error``:
OpenRouter forwards an upstream failure that way; when its ``error.code`` is an HTTP status, or
``context_length_exceeded``, it is handled as that status would be) are retried with
exponential backoff and jitter, honouring ``retry-after-ms`` and ``Retry-After`` (seconds or an
HTTP date; 0 or a date passed is no instruction: the backoff applies), at most ``max_retries``
times, and only while the wait still ends before the absolute deadline the call was given and
within ``retry_max_seconds`` of the first attempt. A wait that would cross either gives up at
once with the last error; a Retry-After that was the reason is carried on the error
(``retry_after_seconds``), and the outage back-off honours it. A read timeout is retried at
most ``read_timeout_retries`` times (a slow answer is billed each time), then fails with the
reason ``read_timeout``: not an outage. Other 4xx and an answer that is not a chat completion
fail at once. Each retry is one ``event=model_retry`` log line (status, code, attempt, wait),
never message content. Every failure carries its ``reason`` (docs/providers.md).

``ModelUnavailable.transient`` says whether the failure is an outage (the endpoint unreachable,
408, 429, 502, 503, 504 and other 5xx, an error object in a 200 without a status) rather than an
answer about this request (other 4xx, and a 409, 500, 501 or 505 that persists through the
retries): the loops do not fail a session on an outage, they resume it later
(harness.outage).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import requests
import requests.adapters

from harness.errors import ModelUnavailable
from logfmt import log_event
from models.budget import Reservation

log = logging.getLogger(__name__)

#: Longest summary of an error body carried in an exception message.
ERROR_SUMMARY_CHARS = 200
#: Only this head of an error body is searched for echoed prompt text; the rest is never shown.
_ERROR_SCAN_CHARS = 600
#: A run of at least this many characters shared with the request messages counts as an echo.
_ECHO_WINDOW_CHARS = 16
#: Shorter message texts are redacted only where they occur whole.
_ECHO_MIN_CHARS = 4
_REDACTED = "[redacted]"
_ERRNO_REASON = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")


#: First backoff of a retry; doubled at each further attempt (before jitter).
DEFAULT_RETRY_BASE_SECONDS = 0.5
#: Longest backoff between two attempts when the server gives no Retry-After.
RETRY_BACKOFF_CAP_SECONDS = 8.0
#: HTTP statuses worth another attempt (besides every 5xx), as the official openai client has them.
_RETRY_STATUSES = frozenset({408, 409, 429})
#: Retried statuses that still are not an outage when they persist through the retries: the
#: server answered about THIS request (a 500 it raises on every try, a conflict), so the run fails
#: with the reason instead of waiting for a provider that is up.
_NOT_OUTAGE_STATUSES = frozenset({409, 500, 501, 505})
#: ``error.code`` values that mean the request is longer than the model's context.
_CONTEXT_CODES = frozenset({"context_length_exceeded", "string_above_max_length", "request_too_large"})
#: Lower-cased phrases of an error message that mean the same, for providers that give no code.
_CONTEXT_PHRASES = ("context length", "context_length", "maximum context", "context window", "too many tokens")
#: finish_reason values that say the answer is not the model's whole answer.
INCOMPLETE_FINISH_REASONS = frozenset({"length", "content_filter", "refusal"})
#: Keys of an assistant message that the client reads or that are only ever part of an answer;
#: every other key (``reasoning_content``, ``thinking_blocks``, ``reasoning_details``, ...) is a
#: provider field, kept as sent and sent back with the message (docs/providers.md).
_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "function_call", "annotations", "audio"})
#: Keys of a tool call that the client reads; every other key (Gemini's ``extra_content`` with
#: its thought signature) is kept as the provider sent it and sent back unchanged.
_TOOL_CALL_KEYS = frozenset({"id", "type", "function"})


@dataclass(frozen=True)
class ModelOptions:
    """Per-agent options of a chat completion (AGENTS_FILE ``model``, ``temperature``,
    ``max_tokens``, ``max_completion_tokens``: the o-series and gpt-5 take only the latter);
    None leaves the endpoint's default (``model``: the client's MODEL_NAME)."""

    model: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


@dataclass(frozen=True)
class ToolCall:
    """One function call the model asked for."""

    id: str
    name: str
    arguments: str  #: JSON text as the model sent it
    #: The provider's own fields of the call (Gemini's ``extra_content`` thought signature),
    #: kept as sent: the provider wants them back with the call.
    extra: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_openai(self) -> dict[str, Any]:
        """The call as an assistant message carries it in the OpenAI format."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {**self.extra, **call} if self.extra else call

    @classmethod
    def from_openai(cls, call: dict[str, Any]) -> ToolCall:
        """The call from its OpenAI form as ``to_openai`` wrote it (a journal, a history row)."""
        function = call.get("function") or {}
        extra = {k: v for k, v in call.items() if k not in _TOOL_CALL_KEYS}
        return cls(str(call["id"]), str(function.get("name")), str(function.get("arguments") or ""), extra)


@dataclass(frozen=True)
class ModelReply:
    """The first choice of a chat completion, with the token usage the endpoint reported (0 when absent)."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]
    prompt_tokens: int
    completion_tokens: int
    #: Why the model stopped ("stop", "tool_calls", "length", "content_filter", ...; None: not said).
    finish_reason: str | None = None
    #: The model's refusal text, when it refused (OpenAI's ``message.refusal``).
    refusal: str | None = None
    #: The assistant message's other fields, as the provider sent them (reasoning, thinking
    #: blocks, ``content`` as a list of typed parts): sent back with the message.
    provider_fields: dict[str, Any] = field(default_factory=dict, hash=False)
    #: Prompt tokens served from the provider's cache (``prompt_tokens_details.cached_tokens``,
    #: DeepSeek's ``prompt_cache_hit_tokens``, Anthropic's ``cache_read_input_tokens``).
    cached_tokens: int = 0
    #: Completion tokens spent on reasoning (``completion_tokens_details.reasoning_tokens``).
    reasoning_tokens: int = 0
    #: The model that answered, as the provider named it (None: not said, or a journaled reply).
    model: str | None = None
    #: The tree budget's reservation this call holds, settled with the reply's usage (None: the
    #: tree has no budget, or a journaled reply: models.budget).
    reservation: Reservation | None = field(default=None, compare=False)

    @property
    def incomplete(self) -> str | None:
        """Why this answer is not the model's whole answer ("length": cut off, "content_filter":
        filtered, "refusal": refused, "no_tool_calls": it said it called tools and sent no
        call), or None when it is."""
        if self.refusal:
            return "refusal"
        if self.finish_reason == "tool_calls" and not self.tool_calls:
            return "no_tool_calls"
        return self.finish_reason if self.finish_reason in INCOMPLETE_FINISH_REASONS else None


def _session_for(url: str) -> requests.Session:
    """A keep-alive session whose environment settings (proxy variables, ``REQUESTS_CA_BUNDLE``
    / ``CURL_CA_BUNDLE``) are read ONCE, here, instead of at every request: requests'
    ``trust_env`` scans the environment (and ``~/.netrc``) on each call, a measurable part of a
    short model call. A provider behind a proxy still goes through it.

    One client serves every loop of a process (``tasks.agent``): its connection pool keeps a
    connection per loop the process runs at once (``models.db.loops_per_process``, a threads
    pool's concurrency), else urllib3 keeps 10 per host and connects anew for every call past
    them."""
    from models.db import loops_per_process

    session = requests.Session()
    per_host = max(requests.adapters.DEFAULT_POOLSIZE, loops_per_process())
    for prefix in ("https://", "http://"):
        session.mount(prefix, requests.adapters.HTTPAdapter(pool_maxsize=per_host))
    session.proxies.update(requests.utils.get_environ_proxies(url))
    bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    if bundle:
        session.verify = bundle
    session.trust_env = False
    return session


class ModelClient:
    """A chat-completions client on one ``requests.Session``; meant for one agent loop at a time."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        model: str,
        connect_timeout: float,
        read_timeout: float,
        *,
        max_retries: int = 0,
        retry_max_seconds: float = 0.0,
        retry_base_seconds: float = DEFAULT_RETRY_BASE_SECONDS,
        read_timeout_retries: int = 0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        #: Retries after the first attempt (0: none), within retry_max_seconds of the first attempt.
        self.max_retries = max_retries
        self.retry_max_seconds = retry_max_seconds
        self.retry_base_seconds = retry_base_seconds
        #: Retries after a read timeout (their own count: a slow answer is billed each time).
        self.read_timeout_retries = read_timeout_retries
        self._api_key = api_key
        self._url = f"{self.base_url}/chat/completions"
        #: The endpoint as messages may show it: no userinfo, no query.
        self._where = _safe_url(self._url)
        self._session = _session_for(self._url)

    @classmethod
    def from_settings(cls) -> ModelClient:
        """A client for MODEL_BASE_URL / MODEL_API_KEY / MODEL_NAME, the MODEL_* timeouts and
        retries (MODEL_MAX_RETRIES, MODEL_RETRY_MAX_SECONDS)."""
        from settings import get_settings

        s = get_settings()
        return cls(
            s.MODEL_BASE_URL,
            s.MODEL_API_KEY,
            s.MODEL_NAME,
            s.MODEL_CONNECT_TIMEOUT_SECONDS,
            s.MODEL_READ_TIMEOUT_SECONDS,
            max_retries=s.MODEL_MAX_RETRIES,
            retry_max_seconds=s.MODEL_RETRY_MAX_SECONDS,
            read_timeout_retries=s.MODEL_READ_TIMEOUT_RETRIES,
        )

    def __repr__(self) -> str:
        return f"ModelClient(base_url={self._where!r}, model={self.model!r})"

    def close(self) -> None:
        self._session.close()

    def complete(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        timeout: float | None = None,
        options: ModelOptions | None = None,
    ) -> ModelReply:
        """One chat completion, retried as the module docstring says. ``timeout`` is the time left
        to an absolute deadline: it caps every attempt's connect and read timeouts and every wait
        between attempts, and a deadline already passed fails without a request."""
        started = time.monotonic()
        give_up_at = started + timeout if timeout is not None else None
        retry_until = started + self.retry_max_seconds
        body: dict[str, Any] = {"model": (options.model if options else None) or self.model, "messages": messages}
        if options is not None and options.temperature is not None:
            body["temperature"] = options.temperature
        if options is not None and options.max_tokens is not None:
            body["max_tokens"] = options.max_tokens
        if options is not None and options.max_completion_tokens is not None:
            body["max_completion_tokens"] = options.max_completion_tokens
        if tools:
            body["tools"] = tools
        # Serialized here so that a message that is not JSON is a programming error (TypeError),
        # not a transport failure.
        data = json.dumps(body).encode("utf-8")
        attempt = timeouts = 0
        while True:
            left = None if give_up_at is None else give_up_at - time.monotonic()
            try:
                return self._attempt(data, messages, left)
            except _Retryable as failure:
                now = time.monotonic()
                if failure.read_timeout:
                    # Its own count, not the retry window: one attempt may outlast the window.
                    timeouts += 1
                    wait = self._backoff(timeouts, None)
                    if timeouts > self.read_timeout_retries or (give_up_at is not None and now + wait >= give_up_at):
                        raise failure.error from failure.__cause__
                else:
                    attempt += 1
                    wait = self._backoff(attempt, failure.retry_after)
                    if (
                        attempt > self.max_retries
                        or now + wait > retry_until
                        or (give_up_at is not None and now + wait >= give_up_at)
                    ):
                        if failure.retry_after is not None:
                            # The provider named the wait: an outage whose back-off honours it.
                            failure.error.transient = True
                            failure.error.retry_after_seconds = failure.retry_after
                        raise failure.error from failure.__cause__
                log_event(
                    log,
                    "model_retry",
                    attempt=attempt,
                    status=failure.status,
                    error_code=failure.error.code,
                    wait_ms=int(wait * 1000),
                )
                time.sleep(wait)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before attempt ``attempt + 1``: the server's Retry-After when it gave one,
        else exponential backoff with equal jitter (half fixed, half random), capped."""
        if retry_after is not None:
            return retry_after
        backoff = min(RETRY_BACKOFF_CAP_SECONDS, self.retry_base_seconds * 2.0 ** (attempt - 1))
        return backoff / 2 + random.uniform(0, backoff / 2)

    def _attempt(self, data: bytes, messages: list[dict[str, Any]], left: float | None) -> ModelReply:
        """One HTTP request. Raises _Retryable for what may be tried again, ModelUnavailable else."""
        connect, read = self.connect_timeout, self.read_timeout
        if left is not None:
            if left <= 0:
                raise ModelUnavailable(
                    f"no time left for a model call to {self._where}", code="timeout", reason="deadline"
                )
            connect, read = min(connect, left), min(read, left)
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        started = time.monotonic()
        try:
            response = self._session.post(
                self._url, data=data, headers=headers, timeout=(connect, read), allow_redirects=False
            )
        except requests.ConnectTimeout as exc:
            error = self._unavailable(
                f"could not connect to {self._where} within {connect:g}s", "connect", transient=True
            )
            raise _Retryable(error, None, None) from exc
        except requests.Timeout as exc:
            # A read capped by the time left to the deadline ran into the deadline.
            reason = "deadline" if read < self.read_timeout else "read_timeout"
            error = self._unavailable(f"{self._where} did not answer within {read:g}s", "timeout", reason=reason)
            raise _Retryable(error, None, None, read_timeout=True) from exc
        except requests.RequestException as exc:
            error = self._unavailable(f"could not reach {self._where}: {_reason(exc)}", "connect", transient=True)
            raise _Retryable(error, None, None) from exc
        duration_ms = int((time.monotonic() - started) * 1000)
        status = response.status_code
        should_retry = _should_retry(response.headers.get("x-should-retry"))
        if not 200 <= status < 300:
            raise self._status_failure(status, response, messages, duration_ms, should_retry)
        try:
            payload = response.json()
        except ValueError as exc:
            raise self._unavailable(
                f"{self._where} answered HTTP {status} with a body that is not JSON", "bad_response"
            ) from exc
        if isinstance(payload, dict) and payload.get("error") and not payload.get("choices"):
            # An error object in a 200 (OpenRouter forwards an upstream failure this way, with
            # the upstream's status in ``error.code``): as that status would be, when it has one.
            upstream = _upstream_status(payload["error"])
            if upstream is not None:
                raise self._status_failure(upstream, response, messages, duration_ms, should_retry, in_body=True)
            summary = _summarize_error(response.text, _request_texts(messages), self._api_key)
            log_event(log, "model_call_failed", status=status, error_code="provider_error", duration_ms=duration_ms)
            retry = should_retry is not False
            error = self._unavailable(
                f"{self._where} answered HTTP {status} with an error: {summary}", "provider_error", transient=retry
            )
            if retry:
                raise _Retryable(error, status, _retry_after(response.headers))
            raise error
        reply = self._parse(payload)
        log_event(
            log,
            "model_call",
            logging.DEBUG,
            status=status,
            duration_ms=duration_ms,
            prompt_tokens=reply.prompt_tokens,
            completion_tokens=reply.completion_tokens,
            tool_calls=len(reply.tool_calls),
        )
        return reply

    def _status_failure(
        self,
        status: int,
        response: requests.Response,
        messages: list[dict[str, Any]],
        duration_ms: int,
        should_retry: bool | None,
        *,
        in_body: bool = False,
    ) -> Exception:
        """The failure an HTTP error status stands for (the response's own, or the upstream's in
        the error object of a 200): ``_Retryable`` when it may be tried again, else the
        ModelUnavailable with its reason."""
        code = "http_5xx" if status >= 500 else "http_4xx" if status >= 400 else "bad_response"
        summary = _summarize_error(response.text, _request_texts(messages), self._api_key)
        log_event(log, "model_call_failed", status=status, error_code=code, duration_ms=duration_ms)
        retry = should_retry if should_retry is not None else status in _RETRY_STATUSES or status >= 500
        outage = retry and status not in _NOT_OUTAGE_STATUSES
        reason = "model_unavailable" if outage else _reason_of(status, response.text)
        said = f"HTTP {response.status_code} with an upstream {status}" if in_body else f"HTTP {status}"
        error = self._unavailable(f"{self._where} answered {said}: {summary}", code, transient=outage, reason=reason)
        if retry:
            return _Retryable(error, status, _retry_after(response.headers))
        return error

    def _unavailable(
        self, message: str, code: str, *, transient: bool = False, reason: str | None = None
    ) -> ModelUnavailable:
        if self._api_key:
            message = message.replace(self._api_key, _REDACTED)
        return ModelUnavailable(message, code=code, transient=transient, reason=reason)

    def _parse(self, payload: Any) -> ModelReply:
        def bad(what: str) -> ModelUnavailable:
            return self._unavailable(f"{self._where} answered with {what}", "bad_response")

        if not isinstance(payload, dict):
            raise bad("a JSON value that is not an object")
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise bad("no choices")
        message = choices[0].get("message")
        if not isinstance(message, dict):
            raise bad("a choice without a message")
        content = message.get("content")
        provider_fields = {k: v for k, v in message.items() if k not in _MESSAGE_KEYS and v is not None}
        if isinstance(content, list):
            # Typed parts (a reasoning model's thinking beside its text): the text parts are
            # the answer; the list goes back to the provider whole.
            provider_fields["content"] = content
            content = _text_of_parts(content)
        elif content is not None and not isinstance(content, str):
            raise bad("message content that is not text")
        refusal = message.get("refusal")
        finish_reason = choices[0].get("finish_reason")
        raw_calls = message.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise bad("tool_calls that are not a list")
        calls: list[ToolCall] = []
        for position, raw in enumerate(raw_calls):
            call = _parse_tool_call(raw)
            if call is None:
                raise bad(f"a malformed tool call at position {position}")
            calls.append(call)
        usage = payload.get("usage")
        if not isinstance(usage, dict):
            usage = {}
        return ModelReply(
            content=content,
            tool_calls=tuple(calls),
            prompt_tokens=_count(usage.get("prompt_tokens")),
            completion_tokens=_count(usage.get("completion_tokens")),
            finish_reason=finish_reason if isinstance(finish_reason, str) else None,
            refusal=refusal if isinstance(refusal, str) and refusal else None,
            provider_fields=provider_fields,
            cached_tokens=_cached_tokens(usage),
            reasoning_tokens=_count(_detail(usage, "completion_tokens_details", "reasoning_tokens")),
            model=model if isinstance(model := payload.get("model"), str) and model else None,
        )


class _Retryable(Exception):
    """Control flow only: an attempt failed in a way worth another attempt."""

    def __init__(
        self, error: ModelUnavailable, status: int | None, retry_after: float | None, *, read_timeout: bool = False
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.status = status
        self.retry_after = retry_after
        self.read_timeout = read_timeout


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds the server asks us to wait: ``retry-after-ms`` (OpenAI's), else ``Retry-After``
    (delta-seconds or an HTTP date). None when absent, unreadable, or not in the future (a
    ``Retry-After: 0`` is no instruction: the client's own backoff applies, never no pause)."""
    millis = _seconds(headers.get("retry-after-ms"))
    if millis is not None and millis > 0:
        return millis / 1000.0
    value = (headers.get("Retry-After") or "").strip()
    if not value:
        return None
    seconds = _seconds(value)
    if seconds is None:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - time.time()
    return seconds if seconds > 0 else None


def _seconds(value: str | None) -> float | None:
    if not value:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _upstream_status(error: Any) -> int | None:
    """The HTTP status an error object in a 200 stands for: its ``code`` when that is a status
    (a number or its digits), 400 for a context-length code; None when it names none."""
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    if isinstance(code, str) and code.strip().isdigit():
        code = int(code.strip())
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    if isinstance(code, str) and code in _CONTEXT_CODES:
        return 400
    return None


def _reason_of(status: int, body: str) -> str:
    """The failure code of a refusal of this request (docs/providers.md, "Failure reasons")."""
    if status in (401, 403):
        return "auth"
    if status == 404:
        return "model_not_found"
    if status == 413 or _says_context_too_long(body):
        return "context_too_long"
    return "provider_rejected" if status < 500 else "provider_error"


def _says_context_too_long(body: str) -> bool:
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and error.get("code") in _CONTEXT_CODES:
        return True
    head = body[:_ERROR_SCAN_CHARS].lower()
    return any(phrase in head for phrase in _CONTEXT_PHRASES)


def _should_retry(value: str | None) -> bool | None:
    """The server's ``x-should-retry`` header: True/False when it says, None when it does not."""
    if value is None:
        return None
    value = value.strip().lower()
    return True if value == "true" else False if value == "false" else None


def _parse_tool_call(raw: Any) -> ToolCall | None:
    """None when the call has no function name. A missing id is made up (some servers omit it);
    arguments sent as an object are re-encoded as JSON text."""
    if not isinstance(raw, dict):
        return None
    function = raw.get("function")
    if not isinstance(function, dict):
        return None
    name = function.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = function.get("arguments")
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    call_id = raw.get("id")
    if not isinstance(call_id, str) or not call_id:
        call_id = f"call_{uuid.uuid4().hex[:24]}"
    extra = {k: v for k, v in raw.items() if k not in _TOOL_CALL_KEYS}
    return ToolCall(id=call_id, name=name, arguments=arguments, extra=extra)


def _text_of_parts(parts: list[Any]) -> str | None:
    """The text of a ``content`` list: its ``{"type": "text"}`` parts joined; None when it has none."""
    texts = [
        p["text"] for p in parts if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
    ]
    return "".join(texts) if texts else None


def _detail(usage: dict[str, Any], group: str, key: str) -> Any:
    details = usage.get(group)
    return details.get(key) if isinstance(details, dict) else None


def _cached_tokens(usage: dict[str, Any]) -> int:
    """Prompt tokens read from the provider's cache, wherever the provider reports them."""
    for value in (
        _detail(usage, "prompt_tokens_details", "cached_tokens"),
        usage.get("prompt_cache_hit_tokens"),
        usage.get("cache_read_input_tokens"),
    ):
        if _count(value):
            return _count(value)
    return 0


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _safe_url(url: str) -> str:
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _reason(exc: requests.RequestException) -> str:
    """The OS reason of a transport failure ("Connection refused"), else the exception's type."""
    match = _ERRNO_REASON.search(str(exc))
    return match.group(1).strip() if match else type(exc).__name__


def _request_texts(messages: Iterable[Any]) -> list[str]:
    """Every text the request carried: message contents and tool-call arguments."""
    texts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                texts.append(function["arguments"])
    return texts


def _summarize_error(body: str, request_texts: list[str], api_key: str) -> str:
    """The error's own message (``error.message`` when the body is OpenAI-shaped), on one line,
    with the key and any echo of the request redacted, cut to ERROR_SUMMARY_CHARS."""
    detail = body
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            detail = error["message"]
        elif isinstance(error, str):
            detail = error
        elif isinstance(parsed.get("message"), str):
            detail = parsed["message"]
        elif isinstance(parsed.get("detail"), str):
            detail = parsed["detail"]
    if api_key:
        detail = detail.replace(api_key, _REDACTED)
    detail = " ".join(detail.split())[:_ERROR_SCAN_CHARS]
    detail = _redact_echo(detail, [" ".join(t.split()) for t in request_texts])
    if len(detail) > ERROR_SUMMARY_CHARS:
        detail = detail[: ERROR_SUMMARY_CHARS - 1] + "…"
    return detail or "(empty body)"


def _redact_echo(text: str, request_texts: list[str]) -> str:
    """Replace every stretch of ``text`` that repeats request text: runs of at least
    _ECHO_WINDOW_CHARS characters found in any request text, and short request texts found whole."""
    if not text or not request_texts:
        return text
    haystack = "\x00".join(request_texts)
    covered = [False] * len(text)
    window = _ECHO_WINDOW_CHARS
    for start in range(len(text) - window + 1):
        if text[start : start + window] in haystack:
            covered[start : start + window] = [True] * window
    for short in request_texts:
        if _ECHO_MIN_CHARS <= len(short) < window:
            at = text.find(short)
            while at >= 0:
                covered[at : at + len(short)] = [True] * len(short)
                at = text.find(short, at + 1)
    if not any(covered):
        return text
    out: list[str] = []
    for position, char in enumerate(text):
        if not covered[position]:
            out.append(char)
        elif position == 0 or not covered[position - 1]:
            out.append(_REDACTED)
    return "".join(out)
