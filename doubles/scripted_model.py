"""Scripted model server: a real OpenAI-compatible HTTP server on loopback, for tests and the demo.

The script is JSON, an ordered list of rules (or ``{"rules": [...]}``)::

    {"when": {"system_contains": "...", "user_contains": "...", "turn": 1, "last_role": "tool"},
     "reply": {"content": "done: {tool_results}"} | {"tool_calls": [{"name": "echo", "arguments": {...}}]}
              | {"content": "half an answ", "finish_reason": "length"}
              | {"error": {"status": 500, "message": "..."}},
     (a call's "arguments" given as a text is sent as is, e.g. "" or '{"text": "hel': arguments
      that are not JSON, as a model sometimes sends them;
      a content or tool_calls reply may add "message_fields": {"reasoning_content": "...", ...}:
      more fields of the assistant message, sent as given; a "content" among them replaces the
      text, e.g. with a list of typed parts; and "usage": {...}: more fields of the answer's usage
      object, e.g. {"prompt_tokens_details": {"cached_tokens": 8}})
     "delay_seconds": 0.5 | {"lognormal": [MU, SIGMA]},
     "fail_first": [{"status": 429, "retry_after": 1}, {"status": 503}, {"drop_connection": true}]}

The first rule whose every condition holds answers; a request no rule matches gets HTTP 400
naming the head of its system prompt. Before any rule is looked at, the message sequence is
checked as the real chat-completions APIs check it: an assistant message with ``tool_calls``
must be followed at once by one TOOL message per call id, and a TOOL message must answer a call
of the assistant message right before its run of TOOL messages. An illegal sequence gets HTTP
400 with an OpenAI-style error body (code ``invalid_message_sequence``) and is not journaled.

``turn`` is the number of assistant messages in the request; ``user_contains`` tests the FIRST
user message. In ``content`` (and an error's ``message``), ``{tool_results}`` becomes the contents
of the tool messages after the last assistant message joined by newlines, and ``{user}`` the
first user message.

``fail_first`` (optional) makes a rule answer like a provider under load: the first N requests
it matches get these failures in order (an HTTP error with an optional ``Retry-After`` header in
seconds, or the connection closed without an answer), and only the next ones its ``reply``. Each
failure is journaled as ``{"rule", "turn", "reply": "error"}``.

``GET /_journal`` lists every answered request as ``{"rule", "turn", "reply"}``; ``POST /_reset``
clears it (and the ``fail_first`` counts). ``GET /_received`` lists what each chat-completions
request asked for besides its messages: ``{"model", "temperature", "max_tokens", "tools"}`` (tool
names; absent options are null). In-process, ``sent_back_extras()`` lists per request the
``extra_content`` of every assistant tool call it sent back (a provider's own call fields), and
``sent_back_messages()`` every assistant message each request carried, as sent.
Run it with ``agent-recovery scripted-model serve --script FILE --port N`` (or
``python -m doubles.scripted_model`` with the same flags).
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TextIO

from logfmt import log_event

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
#: Head of the system prompt that a no-match error names.
SYSTEM_HEAD_CHARS = 60
#: Largest request body the server reads.
MAX_BODY_BYTES = 64 * 1024 * 1024
#: A kept-alive connection with no request for this long is closed (nginx's default is 75 s).
IDLE_CONNECTION_SECONDS = 60.0

_RULE_KEYS = frozenset({"when", "reply", "delay_seconds", "fail_first"})
_FAILURE_KEYS = frozenset({"status", "retry_after", "message", "drop_connection"})
#: Status of a scripted failure that closes the connection without an answer.
DROP_CONNECTION = 0
_WHEN_KEYS = frozenset({"system_contains", "user_contains", "turn", "last_role"})
_REPLY_KEYS = frozenset({"content", "tool_calls", "error", "finish_reason", "message_fields", "usage"})
_TOOL_CALL_KEYS = frozenset({"name", "arguments", "id", "extra_content"})
_ERROR_KEYS = frozenset({"status", "message"})

Script = list[Any] | dict[str, Any] | str | os.PathLike[str]


class ScriptError(ValueError):
    """The model script is invalid."""


@dataclass(frozen=True)
class When:
    """Conditions of a rule; None means "not tested"."""

    system_contains: str | None = None
    user_contains: str | None = None
    turn: int | None = None
    last_role: str | None = None

    def matches(self, request: RequestView) -> bool:
        if self.system_contains is not None and (request.system is None or self.system_contains not in request.system):
            return False
        if self.user_contains is not None and (request.user is None or self.user_contains not in request.user):
            return False
        if self.turn is not None and self.turn != request.turn:
            return False
        return self.last_role is None or self.last_role == request.last_role


@dataclass(frozen=True)
class ScriptedCall:
    name: str
    arguments: str  #: JSON text, as a model sends it
    id: str | None = None  #: a fixed tool_call id (tests of a model that repeats ids); else a fresh one
    #: A provider's own field of the call, sent as is (Gemini's thought signature), JSON text.
    extra_content: str | None = None


@dataclass(frozen=True)
class Reply:
    """Exactly one of: ``content``, ``tool_calls``, or an error status."""

    content: str | None = None
    tool_calls: tuple[ScriptedCall, ...] = ()
    error_status: int | None = None
    error_message: str = ""
    #: A content reply's finish_reason ("length", "content_filter", ...; default "stop").
    finish_reason: str = "stop"
    #: More fields of the assistant message (reasoning, thinking blocks), JSON text of an object.
    message_fields: str | None = None
    #: More fields of the answer's usage object (token details), JSON text of an object.
    usage: str | None = None

    @property
    def kind(self) -> str:
        """What the journal records: "content", "tool_calls" or "error"."""
        if self.error_status is not None:
            return "error"
        return "tool_calls" if self.tool_calls else "content"


@dataclass(frozen=True)
class Failure:
    """One scripted failure of ``fail_first``: an HTTP error status (DROP_CONNECTION: the
    connection is closed without an answer) and an optional Retry-After in seconds."""

    status: int
    retry_after: float | None = None
    message: str = "scripted overload"


@dataclass(frozen=True)
class Rule:
    index: int
    when: When
    reply: Reply
    delay_seconds: float = 0.0
    fail_first: tuple[Failure, ...] = ()
    #: ``(mu, sigma)``: each answer waits ``random.lognormvariate(mu, sigma)`` seconds instead.
    delay_lognormal: tuple[float, float] | None = None

    def delay(self) -> float:
        """Seconds this answer waits: the fixed delay, or a draw of the lognormal one."""
        if self.delay_lognormal is not None:
            return random.lognormvariate(*self.delay_lognormal)
        return self.delay_seconds


@dataclass(frozen=True)
class RequestView:
    """What rules look at in a chat-completions request."""

    system: str | None  #: content of the first system message
    user: str | None  #: content of the FIRST user message
    turn: int  #: number of assistant messages
    last_role: str | None
    tool_results: str  #: contents of the tool messages after the last assistant message, joined by "\n"
    prompt_chars: int

    @classmethod
    def of(cls, messages: list[Any]) -> RequestView:
        msgs = [m for m in messages if isinstance(m, dict)]
        system = next((_text(m.get("content")) for m in msgs if m.get("role") == "system"), None)
        user = next((_text(m.get("content")) for m in msgs if m.get("role") == "user"), None)
        last_assistant = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=-1)
        tool_results = "\n".join(_text(m.get("content")) for m in msgs[last_assistant + 1 :] if m.get("role") == "tool")
        last_role = msgs[-1].get("role") if msgs else None
        return cls(
            system=system,
            user=user,
            turn=sum(1 for m in msgs if m.get("role") == "assistant"),
            last_role=last_role if isinstance(last_role, str) else None,
            tool_results=tool_results,
            prompt_chars=sum(len(_text(m.get("content"))) for m in msgs),
        )

    def fill(self, template: str) -> str:
        return template.replace("{tool_results}", self.tool_results).replace("{user}", self.user or "")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def illegal_sequence(messages: list[Any]) -> tuple[int, str] | None:
    """The first tool-call pairing error in ``messages`` as (index, message), or None when legal.

    The rules of the real chat-completions APIs: an assistant message with ``tool_calls`` must be
    followed at once by TOOL messages answering every one of its call ids (in any order), and a
    TOOL message must answer a call id of the assistant message right before its run of TOOL
    messages. The messages use OpenAI's wire shape (``tool_calls[].id``, ``tool_call_id``).
    """
    open_ids: list[str] = []  # calls of the last assistant message not answered yet
    answerable: set[str] = set()  # call ids a TOOL message may answer here
    opened_at = -1
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in answerable:
                return index, (
                    f"Invalid parameter: messages[{index}]: a message with role 'tool' must be a response to a "
                    f"preceding message with 'tool_calls' (tool_call_id {call_id!r} has no such call)"
                )
            if call_id in open_ids:
                open_ids.remove(call_id)
            continue
        if open_ids:
            return opened_at, _unanswered(opened_at, open_ids)
        answerable = set()
        if role == "assistant":
            calls = message.get("tool_calls") or []
            ids = [c.get("id") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
            open_ids = [i for i in ids if isinstance(i, str)]
            answerable = set(open_ids)
            opened_at = index
    if open_ids:
        return opened_at, _unanswered(opened_at, open_ids)
    return None


def _unanswered(index: int, ids: list[str]) -> str:
    return (
        f"An assistant message with 'tool_calls' (messages[{index}]) must be followed by tool messages responding "
        f"to each 'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(ids)}"
    )


# --- loading -------------------------------------------------------------------------------------


def load_script(script: Script) -> tuple[Rule, ...]:
    """Parse and check a script (rules, ``{"rules": [...]}``, or the path of a JSON file holding
    either). Raises ScriptError naming the file and the rule index."""
    where = ""
    if isinstance(script, str | os.PathLike):
        where = f"{os.fspath(script)}: "
        try:
            script = json.loads(Path(script).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ScriptError(f"{where}cannot read the script: {exc.strerror or exc}") from exc
        except ValueError as exc:
            raise ScriptError(f"{where}not valid JSON: {exc}") from exc
    if isinstance(script, dict):
        extra = set(script) - {"rules"}
        if extra or "rules" not in script:
            raise ScriptError(f'{where}a script object must hold exactly one key, "rules"')
        script = script["rules"]
    if not isinstance(script, list):
        raise ScriptError(f"{where}a script is a list of rules")
    try:
        return tuple(_rule(index, raw) for index, raw in enumerate(script))
    except ScriptError as exc:
        raise ScriptError(f"{where}{exc}") from None


def _check_keys(raw: Any, allowed: frozenset[str], what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ScriptError(f"{what} must be an object")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ScriptError(f"{what}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")
    return raw


def _rule(index: int, raw: Any) -> Rule:
    at = f"rule {index}"
    rule = _check_keys(raw, _RULE_KEYS, at)
    if "reply" not in rule:
        raise ScriptError(f"{at}: a rule needs a reply")
    delay = rule.get("delay_seconds", 0)
    lognormal = None
    if isinstance(delay, dict):
        params = delay.get("lognormal")
        numbers = isinstance(params, list) and all(
            isinstance(p, int | float) and not isinstance(p, bool) for p in params
        )
        if set(delay) != {"lognormal"} or not numbers or len(params) != 2 or params[1] < 0:
            raise ScriptError(f'{at}: delay_seconds must be a number >= 0 or {{"lognormal": [MU, SIGMA >= 0]}}')
        lognormal, delay = (float(params[0]), float(params[1])), 0
    if isinstance(delay, bool) or not isinstance(delay, int | float) or delay < 0:
        raise ScriptError(f"{at}: delay_seconds must be a number >= 0")
    return Rule(
        index=index,
        when=_when(at, rule.get("when")),
        reply=_reply(at, rule["reply"]),
        delay_seconds=delay,
        fail_first=_failures(at, rule.get("fail_first", [])),
        delay_lognormal=lognormal,
    )


def _failures(at: str, raw: Any) -> tuple[Failure, ...]:
    if not isinstance(raw, list):
        raise ScriptError(f"{at}: fail_first must be a list of failures")
    out: list[Failure] = []
    for position, item in enumerate(raw):
        where = f"{at} fail_first[{position}]"
        failure = _check_keys(item, _FAILURE_KEYS, where)
        if failure.get("drop_connection") is True:
            if set(failure) != {"drop_connection"}:
                raise ScriptError(f"{where}: drop_connection takes no other key")
            out.append(Failure(status=DROP_CONNECTION))
            continue
        status = failure.get("status")
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise ScriptError(f"{where}: status must be an HTTP error status (400-599)")
        retry_after = failure.get("retry_after")
        if retry_after is not None and (
            isinstance(retry_after, bool) or not isinstance(retry_after, int | float) or retry_after < 0
        ):
            raise ScriptError(f"{where}: retry_after must be a number of seconds >= 0")
        message = failure.get("message", "scripted overload")
        if not isinstance(message, str):
            raise ScriptError(f"{where}: message must be a string")
        out.append(Failure(status=status, retry_after=retry_after, message=message))
    return tuple(out)


def _when(at: str, raw: Any) -> When:
    if raw is None:
        return When()
    when = _check_keys(raw, _WHEN_KEYS, f"{at} when")
    for key in ("system_contains", "user_contains"):
        if key in when and not isinstance(when[key], str):
            raise ScriptError(f"{at} when: {key} must be a string")
    turn = when.get("turn")
    if turn is not None and (isinstance(turn, bool) or not isinstance(turn, int) or turn < 0):
        raise ScriptError(f"{at} when: turn must be an integer >= 0")
    last_role = when.get("last_role")
    if last_role is not None and last_role not in ROLES:
        raise ScriptError(f"{at} when: last_role must be one of {', '.join(ROLES)}")
    return When(when.get("system_contains"), when.get("user_contains"), turn, last_role)


def _reply(at: str, raw: Any) -> Reply:
    reply = dict(_check_keys(raw, _REPLY_KEYS, f"{at} reply"))
    finish_reason = reply.pop("finish_reason", "stop")
    fields = reply.pop("message_fields", None)
    if fields is not None and (not isinstance(fields, dict) or "error" in reply):
        raise ScriptError(f"{at} reply: message_fields is an object, for a content or tool_calls reply")
    message_fields = None if fields is None else json.dumps(fields)
    extra_usage = reply.pop("usage", None)
    if extra_usage is not None and (not isinstance(extra_usage, dict) or "error" in reply):
        raise ScriptError(f"{at} reply: usage is an object, for a content or tool_calls reply")
    usage = None if extra_usage is None else json.dumps(extra_usage)
    if len(reply) != 1:
        raise ScriptError(f"{at} reply: give exactly one of content, tool_calls, error")
    if not isinstance(finish_reason, str) or (finish_reason != "stop" and "content" not in reply):
        raise ScriptError(f"{at} reply: finish_reason is a string, for a content reply")
    if "content" in reply:
        if not isinstance(reply["content"], str):
            raise ScriptError(f"{at} reply: content must be a string")
        return Reply(content=reply["content"], finish_reason=finish_reason, message_fields=message_fields, usage=usage)
    if "error" in reply:
        error = _check_keys(reply["error"], _ERROR_KEYS, f"{at} reply error")
        status = error.get("status")
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise ScriptError(f"{at} reply error: status must be an HTTP error status (400-599)")
        message = error.get("message", "scripted error")
        if not isinstance(message, str):
            raise ScriptError(f"{at} reply error: message must be a string")
        return Reply(error_status=status, error_message=message)
    calls = reply["tool_calls"]
    if not isinstance(calls, list) or not calls:
        raise ScriptError(f"{at} reply: tool_calls must be a non-empty list")
    out: list[ScriptedCall] = []
    for position, raw_call in enumerate(calls):
        call = _check_keys(raw_call, _TOOL_CALL_KEYS, f"{at} tool_calls[{position}]")
        name = call.get("name")
        arguments = call.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise ScriptError(f"{at} tool_calls[{position}]: name must be a non-empty string")
        if not isinstance(arguments, dict | str):
            raise ScriptError(f"{at} tool_calls[{position}]: arguments must be an object, or a text sent as is")
        call_id = call.get("id")
        if call_id is not None and (not isinstance(call_id, str) or not call_id):
            raise ScriptError(f"{at} tool_calls[{position}]: id must be a non-empty string")
        extra = call.get("extra_content")
        out.append(
            ScriptedCall(
                name=name,
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
                id=call_id,
                extra_content=None if extra is None else json.dumps(extra),
            )
        )
    return Reply(tool_calls=tuple(out), message_fields=message_fields, usage=usage)


# --- serving -------------------------------------------------------------------------------------


def _error_body(
    message: str, code: str, kind: str = "invalid_request_error", param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ScriptedModelServer:
    """The server in-process: ``start()`` serves on a background thread (one thread per
    connection, kept alive between requests) and returns the base URL ending in ``/v1``;
    ``stop()`` also cuts short any delayed reply and closes every open connection."""

    def __init__(
        self,
        script: Script,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        *,
        keep_alive: bool = True,
    ) -> None:
        self.rules = load_script(script)
        #: False: HTTP/1.0, one request per connection (a provider or proxy that closes each one).
        self.keep_alive = keep_alive
        self.host = host
        self.port = port
        self._api_key = api_key or None
        self._journal: list[dict[str, Any]] = []
        self._rejected: list[dict[str, Any]] = []
        self._received: list[dict[str, Any]] = []
        self._extras: list[list[Any]] = []  #: per request: the extra_content of the calls it sent back
        self._assistants: list[list[dict[str, Any]]] = []  #: per request: its assistant messages
        self._matched: dict[int, int] = {}  #: how often each rule matched (fail_first counts)
        self._local = threading.local()  #: extra response headers of the request on this thread
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"ScriptedModelServer(host={self.host!r}, port={self.port}, rules={len(self.rules)})"

    @property
    def base_url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the scripted model server is not started")
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> str:
        if self._httpd is not None:
            return self.base_url
        self._stopping.clear()
        httpd = _HTTPServer((self.host, self.port), _Handler if self.keep_alive else _ClosingHandler)
        httpd.app = self
        self.port = int(httpd.server_address[1])
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="scripted-model", daemon=True
        )
        self._thread.start()
        return self.base_url

    def stop(self) -> None:
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        httpd.close_open_connections()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)
        self._httpd = self._thread = None

    def __enter__(self) -> ScriptedModelServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def journal(self) -> list[dict[str, Any]]:
        """Every answered request, in the order answered."""
        with self._lock:
            return [dict(entry) for entry in self._journal]

    def rejected(self) -> list[dict[str, Any]]:
        """Every request refused for an illegal message sequence: ``{"index", "message"}``."""
        with self._lock:
            return [dict(entry) for entry in self._rejected]

    def received(self) -> list[dict[str, Any]]:
        """What each chat-completions request asked for besides its messages, in order:
        ``{"model", "temperature", "max_tokens", "tools"}``."""
        with self._lock:
            return [dict(entry) for entry in self._received]

    def sent_back_extras(self) -> list[list[Any]]:
        """Per request, the ``extra_content`` of every assistant tool call it carried."""
        with self._lock:
            return [list(e) for e in self._extras]

    def sent_back_messages(self) -> list[list[dict[str, Any]]]:
        """Per request, every assistant message it carried, as sent."""
        with self._lock:
            return [[dict(m) for m in ms] for ms in self._assistants]

    def reset(self) -> None:
        with self._lock:
            self._assistants.clear()
            self._extras.clear()
            self._journal.clear()
            self._rejected.clear()
            self._received.clear()
            self._matched.clear()

    def set_script(self, script: Script) -> None:
        """Answer by another script from now on (a provider that comes back after an outage);
        the journal is kept, the ``fail_first`` counts start again."""
        rules = load_script(script)
        with self._lock:
            self.rules = rules
            self._matched.clear()

    def take_headers(self) -> dict[str, str]:
        """Extra headers of the answer this thread just computed (Retry-After), then forgotten."""
        headers: dict[str, str] = getattr(self._local, "headers", {})
        self._local.headers = {}
        return headers

    def answer(self, body: Any, authorization: str | None) -> tuple[int, dict[str, Any]]:
        """Status and JSON body for one chat-completions request."""
        if self._api_key is not None and not hmac.compare_digest(
            (authorization or "").encode(), f"Bearer {self._api_key}".encode()
        ):
            return 401, _error_body("invalid or missing API key", "invalid_api_key")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return 400, _error_body("the request body must be an object with a messages list", "bad_request")
        illegal = illegal_sequence(body["messages"])
        if illegal is not None:
            index, message = illegal
            log_event(log, "scripted_model_illegal_sequence", logging.WARNING, index=index)
            with self._lock:
                self._rejected.append({"index": index, "message": message})
            return 400, _error_body(message, "invalid_message_sequence", param=f"messages.[{index}]")
        request = RequestView.of(body["messages"])
        raw_tools = body.get("tools")
        tools: list[Any] = raw_tools if isinstance(raw_tools, list) else []
        with self._lock:
            self._received.append(
                {
                    "model": body.get("model"),
                    "temperature": body.get("temperature"),
                    "max_tokens": body.get("max_tokens"),
                    "tools": [
                        t["function"].get("name")
                        for t in tools
                        if isinstance(t, dict) and isinstance(t.get("function"), dict)
                    ],
                }
            )
            self._assistants.append(
                [dict(m) for m in body["messages"] if isinstance(m, dict) and m.get("role") == "assistant"]
            )
            self._extras.append(
                [
                    c["extra_content"]
                    for m in body["messages"]
                    if isinstance(m, dict) and m.get("role") == "assistant"
                    for c in m.get("tool_calls") or ()
                    if isinstance(c, dict) and "extra_content" in c
                ]
            )
        rule = next((r for r in self.rules if r.when.matches(request)), None)
        if rule is None:
            head = " ".join((request.system or "")[:SYSTEM_HEAD_CHARS].split()) or "(none)"
            message = (
                f"no script rule matched this request (turn {request.turn}, last_role {request.last_role}); "
                f'system prompt head: "{head}"'
            )
            log_event(log, "scripted_model_no_match", logging.WARNING, turn=request.turn, last_role=request.last_role)
            return 400, _error_body(message, "no_rule_matched")
        delay = rule.delay()
        if delay > 0 and self._stopping.wait(delay):
            return 503, _error_body("the scripted model server is stopping", "stopping", "server_error")
        reply = rule.reply
        with self._lock:
            seen = self._matched.get(rule.index, 0)
            self._matched[rule.index] = seen + 1
            failure = rule.fail_first[seen] if seen < len(rule.fail_first) else None
            self._journal.append(
                {"rule": rule.index, "turn": request.turn, "reply": "error" if failure else reply.kind}
            )
        if failure is not None:
            if failure.retry_after is not None:
                self._local.headers = {"Retry-After": f"{failure.retry_after:g}"}
            kind = "server_error" if failure.status >= 500 else "rate_limit_error"
            return failure.status, _error_body(failure.message, "scripted_failure", kind)
        if reply.error_status is not None:
            kind = "server_error" if reply.error_status >= 500 else "invalid_request_error"
            return reply.error_status, _error_body(request.fill(reply.error_message), "scripted_error", kind)
        message_out: dict[str, Any] = {"role": "assistant", "content": None}
        if reply.tool_calls:
            message_out["tool_calls"] = [
                {
                    "id": call.id or f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                    **({} if call.extra_content is None else {"extra_content": json.loads(call.extra_content)}),
                }
                for call in reply.tool_calls
            ]
            completion_chars = sum(len(call.arguments) for call in reply.tool_calls)
            finish_reason = "tool_calls"
        else:
            message_out["content"] = request.fill(reply.content or "")
            completion_chars = len(message_out["content"])
            finish_reason = reply.finish_reason
        if reply.message_fields is not None:
            message_out.update(json.loads(reply.message_fields))
        prompt_tokens, completion_tokens = max(1, request.prompt_chars // 4), max(1, completion_chars // 4)
        return 200, {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model") or "scripted"),
            "choices": [{"index": 0, "message": message_out, "finish_reason": finish_reason}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                **(json.loads(reply.usage) if reply.usage else {}),
            },
        }


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # tests open many connections at once
    app: ScriptedModelServer

    def server_activate(self) -> None:
        #: The connections a handler thread serves now (kept alive between requests).
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Condition()
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        super().shutdown_request(request)
        with self._open_lock:
            self._open.discard(request)
            self._open_lock.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away between two requests on a kept-alive connection (a SIGKILLed
        # worker: the kernel resets its sockets) is not the server's error; anything else is.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

    def close_open_connections(self, wait: float = 2.0) -> None:
        """End every connection still open: a stopped server takes no more requests on a
        kept-alive connection, as a provider that went away would not. Only the reading side is
        shut: a handler waiting for its next request sees the end and closes the connection, and
        one still answering (a delayed reply cut short) sends its answer first. Waits up to
        ``wait`` seconds for their handlers to close them, so that a client's next call after
        stop() finds its connection ended."""
        with self._open_lock:
            connections = list(self._open)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RD)
            except OSError:
                pass  # already closed by its client
        with self._open_lock:
            self._open_lock.wait_for(lambda: not self._open, timeout=wait)


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 with keep-alive, as providers answer: a client's session sends its next request on
    # the same connection. stop() cuts the open ones; an idle one is closed after
    # IDLE_CONNECTION_SECONDS. No Nagle: a reply's headers and body are two writes, and on a
    # kept-alive connection the body would wait for the client's delayed ACK (40 ms).
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    timeout = IDLE_CONNECTION_SECONDS
    server: _HTTPServer

    def do_GET(self) -> None:
        if _route(self.path) == "/_journal":
            self._send(200, {"requests": self.server.app.journal()})
        elif _route(self.path) == "/_received":
            self._send(200, {"requests": self.server.app.received()})
        else:
            self._send(404, _error_body(f"no such path: {self.path}", "not_found"))

    def do_POST(self) -> None:
        path = _route(self.path)
        if path == "/_reset":
            self._read_body()
            self.server.app.reset()
            self._send(200, {"requests": []})
        elif path == "/chat/completions":
            raw = self._read_body()
            try:
                body = json.loads(raw) if raw is not None else None
            except ValueError:
                self._send(400, _error_body("the request body is not JSON", "bad_request"))
                return
            app = self.server.app
            app.take_headers()
            status, payload = app.answer(body, self.headers.get("Authorization"))
            if status == DROP_CONNECTION:
                self.close_connection = True  # no status line: the client sees a dropped connection
                return
            self._send(status, payload, app.take_headers())
        else:
            self._send(404, _error_body(f"no such path: {self.path}", "not_found"))

    def _read_body(self) -> bytes | None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return None
        if not 0 < length <= MAX_BODY_BYTES:
            self.close_connection = True  # its body is not read: the connection is not reusable
            return None
        return self.rfile.read(length)

    def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode("utf-8")
        try:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its read timeout); nothing to answer

    def log_message(self, format: str, *args: Any) -> None:
        log_event(log, "scripted_model_request", logging.DEBUG, request=format % args)


class _ClosingHandler(_Handler):
    """``keep_alive=False``: HTTP/1.0, every answer closes its connection."""

    protocol_version = "HTTP/1.0"


def _route(path: str) -> str:
    path = path.split("?", 1)[0].rstrip("/")
    return path.removeprefix("/v1")


# --- command line --------------------------------------------------------------------------------


def serve(script: Script, host: str, port: int, api_key: str | None = None, out: TextIO | None = None) -> int:
    """Serve until SIGINT or SIGTERM; print the listening line first (flushed). Main thread only."""
    server = ScriptedModelServer(script, host=host, port=port, api_key=api_key)
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = server.start()
        print(f"scripted model listening on {url}", file=out or sys.stdout, flush=True)
        while not stopping.wait(0.5):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m doubles.scripted_model", description="scripted model server")
    parser.add_argument("--script", required=True, help="JSON script file")
    parser.add_argument("--port", type=int, required=True, help="port (0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    return run(args.script, args.host, args.port)


def run(script: str, host: str, port: int) -> int:
    """``serve`` with MODEL_API_KEY as the expected key (none when empty); a bad script, a bad
    environment or a busy port is a message on stderr and exit status 2."""
    from settings import SettingsError, get_settings

    try:
        return serve(script, host, port, api_key=get_settings().MODEL_API_KEY or None)
    except (ScriptError, SettingsError, OSError) as exc:
        print(f"scripted model: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
