"""The tool registry and the ``@tool`` decorator.

A tool is a plain function. Its name is the function's name (or ``@tool(name=...)``), its
description the docstring, its JSON schema built by pydantic from the type hints, and the
model's arguments are validated by that same pydantic model before the function runs. An
optional first parameter annotated ``ToolContext`` receives the call's context and is not part
of the schema.

What a call can end in (``run_inline``):

- the function's return value (text as is; anything else as JSON);
- ``error: ...`` for an unknown or refused tool, arguments that are not a JSON object or do not
  validate (the pydantic errors, without the values), a ``ToolError`` (its message), or any other
  exception (its type and message, one line, secrets redacted, never a traceback);
- only ``Cancelled``, ``DeadlineExceeded`` and ``LeaseLost`` stop the loop from inside a tool;
  every other exception the tool raises on its thread, whatever its module, and ``SystemExit`` /
  ``KeyboardInterrupt`` too, is that call's TOOL error result (a tool has no access to our
  connections: its database or Redis errors are its own);
- what is raised on the loop's own thread while it waits for the tool (a stopping worker's
  ``SystemExit``) is never a result: it propagates, and the journal's open entry makes recovery
  report the call interrupted (or run it again when it is repeatable).
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import inspect
import json
import logging
import os
import queue
import re
import threading
import time
import typing
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic_core import PydanticSerializationError, to_json

from crashpoints import InjectedKill
from harness.errors import AgentConfigError, Cancelled, DeadlineExceeded, ToolError
from harness.tools.context import ToolContext
from harness.tools.stuck import Reporter
from logfmt import log_event
from models.errors import LeaseLost

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: Longest exception message carried into a TOOL error result.
ERROR_MESSAGE_CHARS = 300
#: MCP tool names are ``<server>__<tool>`` (OpenAI function names allow [A-Za-z0-9_-] only).
MCP_SEPARATOR = "__"
#: A tool name every chat-completions provider accepts (Python and MCP tools alike).
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def valid_tool_name(name: str) -> bool:
    """True for a name every provider accepts as a function name: ^[a-zA-Z0-9_-]{1,64}$."""
    return TOOL_NAME.fullmatch(name) is not None


class ToolDefinitionError(AgentConfigError):
    """Raised when a tool cannot be registered: its name is taken or its schema cannot be built."""

    def __init__(self, message: str, *, tool: str = "", module: str = "") -> None:
        super().__init__(message)
        self.tool = tool
        self.module = module


@dataclass(frozen=True)
class Tool:
    """One tool as the loops see it. ``run`` is None for the delegation tools (the loop turns
    their calls into child executions, docs/tasks.md)."""

    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[[ToolContext, dict[str, Any]], str] | None
    #: Declared crash behaviour (MCP's tool annotation words): safe to run again after a crash.
    read_only: bool = False
    idempotent: bool = False
    #: A human approves every call before it runs (``@tool(requires_approval=True)``).
    requires_approval: bool = False
    #: ``@tool(requires_approval=callable)``: decides per call from its arguments (a dict) whether
    #: a human approves it (harness.approval.rule_decision; a callable that raises: approval).
    approval_rule: Callable[[dict[str, Any]], object] | None = None
    #: How long a call's approval request waits (None: APPROVAL_TIMEOUT_SECONDS; an agent's
    #: ``approval_timeout_seconds`` in AGENTS_FILE overrides both).
    approval_timeout_seconds: float | None = None
    #: MCP's ``destructiveHint`` (None: absent, which the MCP spec reads as destructive; a
    #: read-only tool is never destructive). Python tools: None.
    destructive: bool | None = None
    #: Where it was defined ("harness.tools.builtins", "acme_tools", "mcp:files").
    module: str = ""
    qualname: str = ""
    #: Longest a call may run (None: TOOL_TIMEOUT_SECONDS); a call still running then is
    #: reported timed out (it may or may not have taken effect) and the loop goes on.
    timeout_seconds: float | None = None
    #: Rounds in a row the model may be told to fix this tool's arguments (None:
    #: TOOL_MAX_RETRIES); one more and the session fails (harness.arguments).
    max_retries: int | None = None

    def spec(self) -> dict[str, Any]:
        """The tool as a chat-completions request offers it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


#: Every Python tool of this process, by name, in registration order (built-ins first).
REGISTRY: dict[str, Tool] = {}
#: Bumped by every ``register`` and ``unregister``: what was derived from REGISTRY at one
#: version (harness.release's agents of a release) is derived again at another.
_version = 0


def registry_version() -> int:
    """How many times REGISTRY changed (``register``, ``unregister``) in this process."""
    return _version


def register(entry: Tool) -> Tool:
    """Add ``entry``; a second definition of the same function (a module imported again) replaces
    the first. Raises ToolDefinitionError when another function already holds the name."""
    existing = REGISTRY.get(entry.name)
    if existing is not None and (existing.module, existing.qualname) != (entry.module, entry.qualname):
        raise ToolDefinitionError(
            f"tool {entry.name!r} is defined twice: in module {existing.module} and in module {entry.module}",
            tool=entry.name,
            module=entry.module,
        )
    if MCP_SEPARATOR in entry.name.strip("_"):
        raise ToolDefinitionError(
            f"tool {entry.name!r} in module {entry.module}: a name with {MCP_SEPARATOR!r} is reserved for MCP tools",
            tool=entry.name,
            module=entry.module,
        )
    global _version
    REGISTRY[entry.name] = entry
    _version += 1
    return entry


def unregister(name: str) -> None:
    """Forget a tool (tests that define tools of their own)."""
    global _version
    REGISTRY.pop(name, None)
    _version += 1


@dataclass(frozen=True)
class McpRoom:
    """What the registry asks of the MCP room for a name ``<server>__<tool>``: installed by
    harness.tools.mcp when it is imported, so that the registry imports nothing of it."""

    lookup: Callable[[str], Tool | None]
    unavailable_reason: Callable[[str], str]


_mcp: McpRoom | None = None


def install_mcp(room: McpRoom) -> None:
    """Called once by harness.tools.mcp: MCP tools are looked up through ``room``."""
    global _mcp
    _mcp = room


def tool_names() -> tuple[str, ...]:
    """The names of every registered Python tool, in registration order."""
    return tuple(REGISTRY)


def lookup(name: str) -> Tool | None:
    """The tool of that name: a registered Python tool, or an MCP tool (``<server>__<tool>``) of
    a configured server whose tool list could be read; None otherwise."""
    found = REGISTRY.get(name)
    if found is not None or MCP_SEPARATOR not in name or _mcp is None:
        return found
    return _mcp.lookup(name)


@overload
def tool(fn: F, /) -> F: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    read_only: bool = False,
    idempotent: bool = False,
    timeout_seconds: float | None = None,
    requires_approval: bool | Callable[[dict[str, Any]], object] = False,
    max_retries: int | None = None,
    approval_timeout_seconds: float | None = None,
) -> Callable[[F], F]: ...


def tool(
    fn: F | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    read_only: bool = False,
    idempotent: bool = False,
    timeout_seconds: float | None = None,
    requires_approval: bool | Callable[[dict[str, Any]], object] = False,
    max_retries: int | None = None,
    approval_timeout_seconds: float | None = None,
) -> F | Callable[[F], F]:
    """Register a function as a tool; the function itself is returned unchanged (still callable).

    ``read_only=True`` / ``idempotent=True`` declare that the tool may run again after a crash
    interrupted it (with the same ``ToolContext.idempotency_key``); the default is neither, and
    such a tool is never run twice for one call. ``timeout_seconds`` bounds a call (default
    TOOL_TIMEOUT_SECONDS): a call still running then is reported "timed out, may or may not have
    taken effect" and the loop goes on. ``requires_approval=True``: every call waits for a human
    decision before it runs (harness.approval); ``requires_approval=callable``: the callable gets
    the call's arguments (a dict) and says whether this call waits (true) or not (false); one that
    raises means it waits. ``approval_timeout_seconds``: how long such a call's request waits
    (default APPROVAL_TIMEOUT_SECONDS). ``max_retries``: rounds in a row the model may be
    told to fix this tool's arguments (not JSON, empty, or not what the tool takes; default
    TOOL_MAX_RETRIES); one more and the session fails with the reason ``tool_arguments``.
    Raises ToolDefinitionError (naming the tool and the module) when its name is not
    ^[a-zA-Z0-9_-]{1,64}$, its schema cannot be built, its name is taken, ``timeout_seconds``
    or ``max_retries`` is out of range, or ``approval_timeout_seconds`` is not > 0.
    """

    def wrap(func: F) -> F:
        built = build_tool(
            func,
            name=name,
            description=description,
            read_only=read_only,
            idempotent=idempotent,
            timeout_seconds=timeout_seconds,
            max_retries=max_retries,
        )
        if approval_timeout_seconds is not None and not approval_timeout_seconds > 0:
            raise ToolDefinitionError(
                f"tool {built.name!r} in module {built.module}: approval_timeout_seconds must be > 0",
                tool=built.name,
                module=built.module,
            )
        rule = None if isinstance(requires_approval, bool) else requires_approval
        if rule is not None and not callable(rule):
            raise ToolDefinitionError(
                f"tool {built.name!r} in module {built.module}: requires_approval must be true, false or a callable",
                tool=built.name,
                module=built.module,
            )
        register(
            replace(
                built,
                requires_approval=requires_approval is True,
                approval_rule=rule,
                approval_timeout_seconds=approval_timeout_seconds,
            )
        )
        return func

    return wrap(fn) if fn is not None else wrap


def build_tool(
    func: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    read_only: bool = False,
    idempotent: bool = False,
    timeout_seconds: float | None = None,
    max_retries: int | None = None,
) -> Tool:
    """A Tool for ``func`` without registering it. The docstring's parameter sections (Google
    ``Args:``, reST ``:param x:``, Numpydoc) become the parameters' descriptions, and the rest
    of it the tool's description."""
    tool_name = str(name or getattr(func, "__name__", ""))
    module = str(getattr(func, "__module__", "") or "?")
    if not valid_tool_name(tool_name):
        raise ToolDefinitionError(
            f"tool {tool_name!r} in module {module}: a name is 1-64 ASCII letters, digits, '_' or '-'",
            tool=tool_name,
            module=module,
        )
    if timeout_seconds is not None and not timeout_seconds > 0:
        raise ToolDefinitionError(
            f"tool {tool_name!r} in module {module}: timeout_seconds must be > 0", tool=tool_name, module=module
        )
    if max_retries is not None and (
        isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0
    ):
        raise ToolDefinitionError(
            f"tool {tool_name!r} in module {module}: max_retries must be an integer >= 0", tool=tool_name, module=module
        )
    summary, described = _docstring(func)
    try:
        wants_context, fields = _fields(func, described)
        arguments: type[BaseModel] = create_model(
            f"{tool_name}_arguments", __config__=ConfigDict(extra="forbid"), **fields
        )
        schema = arguments.model_json_schema()
        json.dumps(schema)
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise ToolDefinitionError(
            f"tool {tool_name!r} in module {module}: its JSON schema cannot be built: "
            f"{type(exc).__name__}: {first_line}",
            tool=tool_name,
            module=module,
        ) from exc
    schema.pop("title", None)
    names = tuple(fields)

    def run(ctx: ToolContext, args: dict[str, Any]) -> str:
        try:
            validated = arguments.model_validate(args)
        except ValidationError as exc:
            raise ToolError(f"{INVALID_ARGUMENTS} {tool_name!r}: {describe_validation(exc)}") from None
        kwargs = {n: getattr(validated, n) for n in names}
        result = func(ctx, **kwargs) if wants_context else func(**kwargs)
        if inspect.isawaitable(result):
            # An ``async def`` tool runs to its end on an event loop of its own (the loops are sync).
            result = asyncio.run(_awaited(result))
        return as_text(result)

    return Tool(
        name=tool_name,
        description=description if description is not None else summary,
        parameters=schema,
        run=run,
        read_only=read_only,
        idempotent=idempotent,
        module=module,
        qualname=getattr(func, "__qualname__", tool_name),
        timeout_seconds=timeout_seconds,
        max_retries=max_retries,
    )


def _docstring(func: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The docstring without its parameter sections, and each documented parameter's text."""
    import docstring_parser

    doc = inspect.getdoc(func) or ""
    if not doc:
        return "", {}
    try:
        parsed = docstring_parser.parse(doc)
    except docstring_parser.ParseError:
        return doc, {}
    params = {p.arg_name: " ".join(p.description.split()) for p in parsed.params if p.description}
    if not params:
        return doc, {}
    text = "\n\n".join(part for part in (parsed.short_description, parsed.long_description) if part)
    return text, params


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _fields(func: Callable[..., Any], described: dict[str, str] | None = None) -> tuple[bool, dict[str, Any]]:
    """Whether the first parameter takes the ToolContext, and pydantic field definitions of the
    rest (with the docstring's description of each, unless its type hint has one)."""
    hints = typing.get_type_hints(func, include_extras=True)
    params = list(inspect.signature(func).parameters.values())
    wants_context = bool(params) and hints.get(params[0].name) is ToolContext
    if wants_context:
        params = params[1:]
    fields: dict[str, Any] = {}
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"parameter {param.name!r}: *args, **kwargs and positional-only parameters have no schema")
        if param.name not in hints:
            raise TypeError(f"parameter {param.name!r} has no type hint")
        if hints[param.name] is ToolContext:
            raise TypeError(f"parameter {param.name!r}: only the first parameter may be the ToolContext")
        default = ... if param.default is param.empty else param.default
        text = (described or {}).get(param.name)
        if text and not _has_description(hints[param.name]):
            default = Field(default, description=text)
        fields[param.name] = (hints[param.name], default)
    return wants_context, fields


def _has_description(hint: Any) -> bool:
    """True when an ``Annotated[..., Field(description=...)]`` hint describes the parameter."""
    return any(getattr(meta, "description", None) for meta in getattr(hint, "__metadata__", ()))


def describe_validation(exc: ValidationError) -> str:
    """Each error as ``field: message``, without the input values (they may hold anything)."""
    parts = []
    for err in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in err["loc"]) or "arguments"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def as_text(result: Any) -> str:
    """A tool's return value as the TOOL message content: text as is, None as "", bytes as their
    UTF-8 text, else JSON. Bytes that are not UTF-8 are never an error (the tool did its work):
    they are sent base64-encoded, said so in front (``base64:``); inside a JSON value, every
    bytes value is base64 (URL-safe alphabet) as soon as one of them is not UTF-8."""
    if isinstance(result, str):
        return result
    if result is None:
        return ""
    if isinstance(result, bytes | bytearray | memoryview):
        raw = bytes(result)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(raw).decode("ascii")
    try:
        return to_json(result, fallback=str).decode("utf-8")
    except PydanticSerializationError:
        return to_json(result, fallback=str, bytes_mode="base64").decode("utf-8")


def parse_arguments(raw: str) -> dict[str, Any]:
    """The JSON object of a tool call's arguments; ToolError when it is not one."""
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        raise ToolError("arguments are not valid JSON") from None
    if not isinstance(value, dict):
        raise ToolError("arguments must be a JSON object")
    return value


#: Longest description of a tool's parameters in the answer to arguments that are not JSON.
PARAMETERS_HINT_CHARS = 500
#: How the TOOL errors of arguments the model got wrong begin, after ``error: `` and before the
#: tool's quoted name (harness.arguments counts them, per tool, from the history).
ARGUMENTS_NOT_JSON = "the arguments of tool"
INVALID_ARGUMENTS = "invalid arguments for tool"


def is_argument_error(result: str) -> bool:
    """True for the TOOL result of a call whose arguments the model got wrong: not a JSON
    object, empty, or not what the tool takes."""
    return result.startswith((f"error: {ARGUMENTS_NOT_JSON} ", f"error: {INVALID_ARGUMENTS} "))


def arguments_of(found: Tool, raw: str) -> dict[str, Any]:
    """The call's arguments; a ToolError that tells the model what to fix when they are not a
    JSON object (truncated JSON, text, a list) or empty while the tool has required parameters:
    what was wrong, and the parameters it takes. Empty arguments of a tool that requires none
    are ``{}`` (what several servers send for a call without arguments)."""
    if not raw.strip():
        if not found.parameters.get("required"):
            return {}
        raise ToolError(
            f"{ARGUMENTS_NOT_JSON} {found.name!r} are empty: send the call again with the arguments as one "
            f"JSON object; its parameters: {_parameters_hint(found)}"
        )
    try:
        return parse_arguments(raw)
    except ToolError as exc:
        where = ""
        try:
            json.loads(raw)
        except json.JSONDecodeError as bad:
            where = f" ({bad.msg} at character {bad.pos})"
        raise ToolError(
            f"{ARGUMENTS_NOT_JSON} {found.name!r} {'are not valid JSON' if where else 'are not a JSON object'}"
            f"{where}: send the call again with the arguments as one JSON object; its parameters: "
            f"{_parameters_hint(found)}"
        ) from exc


def _parameters_hint(found: Tool) -> str:
    """``{"city": "string", "nights": "integer"}, required: city, nights`` from the schema."""
    properties = found.parameters.get("properties") or {}
    kinds = {
        name: (spec.get("type") or "any") if isinstance(spec, dict) else "any" for name, spec in properties.items()
    }
    required = found.parameters.get("required") or []
    text = json.dumps(kinds, ensure_ascii=False) + (f", required: {', '.join(map(str, required))}" if required else "")
    return text if len(text) <= PARAMETERS_HINT_CHARS else text[: PARAMETERS_HINT_CHARS - 1] + "…"


def run_inline(name: str, raw_arguments: str, ctx: ToolContext, allowed: tuple[str, ...]) -> str:
    """Run one inline tool and return its TOOL result text. Every failure of the tool itself is
    that text (an error's text capped and redacted like a result); cancellation, the deadline
    and a lost lease propagate so the loop can stop without writing a result. So does whatever
    is raised on the caller's own thread while it waits for the tool (``SystemExit`` from a
    stopping worker's signal handler): that is the process ending, not the tool's result, and
    the journal's open entry tells recovery so."""
    found = lookup(name) if name in allowed else None
    if found is None or found.run is None:
        gone = unavailable_result(name, allowed)
        if gone is not None:
            log_event(log, "tool_unavailable", logging.WARNING, session_id=ctx.session_id, tool=name[:100])
            return gone
        return f"error: tool {name!r} is not available{_unavailable_reason(name)}"
    try:
        ended = _bounded(found, ctx, arguments_of(found, raw_arguments))
    except ToolError as exc:
        return tool_error_result(exc)
    if ended.ok:
        return capped(str(ended.value))
    return _raised_by_tool(name, ctx, ended.value)


class Offered(tuple[str, ...]):
    """The tool names a round offers (a tuple, as everywhere), with the tools of the session's
    release that this worker does not have: a call of one of them gets ``unavailable_result``."""

    release_id: int | None = None
    missing: frozenset[str] = frozenset()


def unavailable_result(name: str, allowed: tuple[str, ...]) -> str | None:
    """The TOOL result of a call of a tool the session's release has and this worker does not
    (``tool_unavailable: not in this deployment (release R)``); None for any other name."""
    if isinstance(allowed, Offered) and name in allowed.missing:
        return f"tool_unavailable: not in this deployment (release {allowed.release_id})"
    return None


def tool_error_result(exc: ToolError) -> str:
    """``error: <message>``, secrets redacted, cut to TOOL_RESULT_MAX_CHARS like any result."""
    return capped(redact(f"error: {exc}"))


def _raised_by_tool(name: str, ctx: ToolContext, exc: BaseException) -> str:
    """The TOOL result of an exception the tool itself raised (on its own thread)."""
    if isinstance(exc, ToolError):
        return tool_error_result(exc)
    if isinstance(exc, Cancelled | DeadlineExceeded | LeaseLost | InjectedKill | GeneratorExit):
        raise exc
    # NOTE: whatever a tool raises is its result, whatever its module: a tool has no access
    # to our connections, so its WRONGTYPE from the shop's own Redis or its UndefinedTable
    # from the shop's own PostgreSQL is the shop's, not our infrastructure failing. So are
    # SystemExit (argparse on bad model input) and KeyboardInterrupt raised by the tool on its
    # own thread: the loop goes on.
    log_event(
        log,
        "tool_failed",
        logging.WARNING,
        session_id=ctx.session_id,
        tool=name,
        tool_call_id=ctx.tool_call_id,
        error=type(exc).__name__,
    )
    return error_result(exc)


class ToolTimedOut(ToolError):
    """Raised when a tool call did not end within its timeout; it may or may not have taken effect."""


def _bounded(found: Tool, ctx: ToolContext, args: dict[str, Any]) -> _Call:
    """Run the call on a thread of its own, in a copy of the caller's context variables, and
    wait at most the tool's timeout (and never past the loop's deadline, nor past a cancel);
    returns the ended call (its value, or what the tool raised). A call still running then is
    left to end on its own (a thread cannot be stopped; it is counted as stuck until it ends):
    ToolTimedOut, DeadlineExceeded when the deadline came first, Cancelled when the session was
    cancelled. What is raised on this thread while it waits (a signal handler's SystemExit)
    propagates as is: it is not the tool's."""
    from settings import get_settings

    assert found.run is not None
    run = found.run
    limit = found.timeout_seconds or get_settings().TOOL_TIMEOUT_SECONDS
    left = ctx.seconds_left()
    by_deadline = left is not None and left < limit
    wait = max(0.0, left) if by_deadline and left is not None else limit
    context = contextvars.copy_context()
    call = _submit(lambda: context.run(run, ctx, args))
    ends_at = time.monotonic() + wait
    while not call.done.wait(max(0.0, min(CANCEL_CHECK_SECONDS, ends_at - time.monotonic()))):
        if _cancelled(ctx) and _abandon(call, found, ctx):
            raise Cancelled(f"cancelled while tool {found.name!r} ran")
        if time.monotonic() < ends_at or not _abandon(call, found, ctx):
            continue
        if by_deadline:
            raise DeadlineExceeded(f"deadline reached while tool {found.name!r} ran")
        log_event(log, "tool_timed_out", logging.WARNING, session_id=ctx.session_id, tool=found.name)
        raise ToolTimedOut(
            f"tool {found.name!r} timed out after {limit:g} seconds; it may or may not have taken effect"
        )
    return call


#: How often the wait for a tool looks at the call's cancellation.
CANCEL_CHECK_SECONDS = 0.1


def _cancelled(ctx: ToolContext) -> bool:
    """The call's cancellation; False when it cannot be read now (the database does not answer):
    the wait goes on, and the loop meets the outage at its next write, as before the tool."""
    try:
        return bool(ctx.cancelled())
    except Exception:
        return False


def _abandon(call: _Call, found: Tool, ctx: ToolContext) -> bool:
    """Stop waiting for a call that is still running: it is counted as a stuck thread until it
    ends. False when it ended meanwhile (its result is used)."""
    global _stuck
    with _idle_lock:
        if call.done.is_set():
            return False
        call.stuck = True
        _stuck += 1
        stuck = _stuck
    _reporter.changed()
    log_event(log, "tool_threads_stuck", logging.WARNING, stuck=stuck, tool=found.name, session_id=ctx.session_id)
    from settings import get_settings

    limit = get_settings().TOOL_MAX_STUCK_THREADS
    if stuck > limit:
        log_event(log, "tool_threads_over_limit", logging.ERROR, stuck=stuck, limit=limit)
    return True


def over_stuck_limit() -> bool:
    """True when more tool threads are stuck than TOOL_MAX_STUCK_THREADS: the process should
    finish its task and stop, so that its supervisor replaces it (tasks.signals does)."""
    from settings import get_settings

    return stuck_threads() > get_settings().TOOL_MAX_STUCK_THREADS


def stuck_threads() -> int:
    """Tool threads of this process still running a call nobody waits for any more (timed out,
    past the deadline, or cancelled)."""
    with _idle_lock:
        return _stuck


class _Call:
    """One tool call handed to a tool thread, and how it ended."""

    __slots__ = ("done", "fn", "ok", "stuck", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.ok = False
        self.stuck = False
        self.value: Any = None


#: Inboxes of idle tool threads. NOTE: a thread is reused once its call ended, so a call costs
#: no thread start; a call that hangs keeps its thread (it cannot be stopped) and the next call
#: gets another one. The threads are daemons: a hung tool never holds the process's exit.
_idle: list[queue.SimpleQueue[_Call]] = []
_idle_lock = threading.Lock()
#: Calls abandoned while still running (see ``stuck_threads``); guarded by ``_idle_lock``.
_stuck = 0
#: Publishes the count for the metrics exporter (harness.tools.stuck).
_reporter = Reporter(stuck_threads)


def _serve(inbox: queue.SimpleQueue[_Call]) -> None:
    global _stuck
    while True:
        call = inbox.get()
        try:
            call.value = call.fn()
            call.ok = True
        except BaseException as exc:  # re-raised on the caller's thread
            call.value = exc
        with _idle_lock:
            # NOTE: done is set under the lock that _abandon takes: a call is either abandoned
            # while running (and counted down here) or seen done by its caller, never both.
            call.done.set()
            if call.stuck:
                _stuck -= 1
            _idle.append(inbox)
        if call.stuck:
            _reporter.changed()


def _submit(fn: Callable[[], Any]) -> _Call:
    call = _Call(fn)
    with _idle_lock:
        inbox = _idle.pop() if _idle else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), name="tool-call", daemon=True).start()
    inbox.put(call)
    return call


def _forget_threads_after_fork() -> None:
    # A forked process (Celery's prefork pool) has none of its parent's threads.
    global _stuck
    _idle.clear()
    _stuck = 0
    _reporter.forget()


os.register_at_fork(after_in_child=_forget_threads_after_fork)


def capped(result: str) -> str:
    """The result cut to TOOL_RESULT_MAX_CHARS, with a note where it was cut."""
    from settings import get_settings

    limit = get_settings().TOOL_RESULT_MAX_CHARS
    if len(result) <= limit:
        return result
    return f"{result[:limit]}\n[cut: the result was {len(result)} characters; the first {limit} are shown]"


def error_result(exc: BaseException) -> str:
    """``error: <type>: <message>`` (one line, secrets redacted), or ``error: <type>``."""
    message = safe_message(exc)
    return f"error: {type(exc).__name__}: {message}" if message else f"error: {type(exc).__name__}"


def _unavailable_reason(name: str) -> str:
    if MCP_SEPARATOR not in name or _mcp is None:
        return ""
    reason = _mcp.unavailable_reason(name)
    return f" ({reason})" if reason else ""


def redact(text: str) -> str:
    """``text`` with the secrets this process knows (model API key, field-recovery key, the
    values of MCP servers' ``${NAME}`` references) replaced by ``[redacted]``."""
    for secret in _secrets():
        text = text.replace(secret, "[redacted]")
    return text


def safe_message(exc: BaseException) -> str:
    """The exception's message on one line, cut to ERROR_MESSAGE_CHARS, with the secrets this
    process knows redacted (``redact``)."""
    text = redact(" ".join(str(exc).split()))
    if len(text) > ERROR_MESSAGE_CHARS:
        text = text[: ERROR_MESSAGE_CHARS - 1] + "…"
    return text


#: Secrets of the tools' own configuration (the values an MCP server's ``${NAME}`` stand for),
#: redacted like the process's own keys.
_tool_secrets: set[str] = set()


def add_secrets(values: Iterable[str]) -> None:
    """Redact these values (4 characters or more) from every tool error from now on."""
    _tool_secrets.update(v for v in values if len(v) >= 4)


def _secrets() -> list[str]:
    extra = sorted(_tool_secrets, key=len, reverse=True)
    try:
        from settings import get_settings

        s = get_settings()
        keys = [s.MODEL_API_KEY, s.booking_field_recovery.open_api.api_key.get_secret_value()]
    except Exception:
        return extra
    return [*extra, *(k for k in keys if len(k) >= 4)]
