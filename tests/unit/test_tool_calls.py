"""How ``run_inline`` runs a Python tool's call: its error capped and redacted, the caller's
context variables, stuck threads counted, a cancel that stops the wait at once, arguments that
are not JSON answered with what to fix (docs/tools.md)."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from harness.errors import Cancelled, ToolError
from harness.tools import ToolContext, registry, run_inline, tool, unregister
from settings import get_settings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def scratch() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        unregister(name)


def ctx(**kw: Any) -> ToolContext:
    return ToolContext(7, kw.pop("tool_call_id", "call_1"), None, **kw)


def test_a_tool_error_message_is_capped_at_the_result_limit_and_redacted(
    scratch: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODEL_API_KEY", "sk-canary-123456")
    get_settings.cache_clear()

    @tool
    def error_page() -> str:
        raise ToolError("upstream 502 for key sk-canary-123456: <html>" + "x" * 200_000)

    scratch.append("error_page")
    try:
        result = run_inline("error_page", "{}", ctx(), ("error_page",))
        limit = get_settings().TOOL_RESULT_MAX_CHARS
    finally:
        get_settings.cache_clear()
    assert result.startswith("error: upstream 502 for key [redacted]: <html>xxx")
    assert "sk-canary" not in result
    assert len(result) <= limit + 200 and "[cut: the result was " in result


trace_id: contextvars.ContextVar[str] = contextvars.ContextVar("trace_id", default="none")


def test_a_tool_runs_in_a_copy_of_the_callers_context(scratch: list[str]) -> None:
    @tool
    def traced() -> str:
        seen = trace_id.get()
        trace_id.set("changed by the tool")
        return seen

    scratch.append("traced")
    token = trace_id.set("trace-1")
    try:
        assert run_inline("traced", "{}", ctx(), ("traced",)) == "trace-1"
        trace_id.set("trace-2")
        assert run_inline("traced", "{}", ctx(tool_call_id="call_2"), ("traced",)) == "trace-2"
        assert trace_id.get() == "trace-2"  # a copy: the tool's own change stays in its call
    finally:
        trace_id.reset(token)


def test_timed_out_calls_are_counted_as_stuck_threads_with_a_warning_until_they_end(
    scratch: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    release = threading.Event()

    @tool(timeout_seconds=0.2)
    def hang() -> str:
        release.wait(30)
        return "done"

    scratch.append("hang")
    before = registry.stuck_threads()
    for n in range(3):
        assert "timed out" in run_inline("hang", "{}", ctx(tool_call_id=f"call_{n}"), ("hang",))
    assert registry.stuck_threads() == before + 3
    assert f"event=tool_threads_stuck stuck={before + 3}" in caplog.text
    release.set()
    deadline = time.monotonic() + 10
    while registry.stuck_threads() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert registry.stuck_threads() == before


def test_a_cancel_stops_the_wait_for_a_tool_at_once(scratch: list[str]) -> None:
    release = threading.Event()
    cancelled = threading.Event()

    @tool(timeout_seconds=30)
    def deaf() -> str:  # never looks at ctx.cancelled
        release.wait(30)
        return "done"

    scratch.append("deaf")
    threading.Timer(0.3, cancelled.set).start()
    started = time.monotonic()
    try:
        with pytest.raises(Cancelled):
            run_inline("deaf", "{}", ctx(cancelled=cancelled.is_set), ("deaf",))
        assert time.monotonic() - started < 2.0
    finally:
        release.set()


@pytest.mark.parametrize("raw", ['{"text": "hel', "not json", "[1, 2]"])
def test_arguments_that_are_not_a_json_object_are_answered_with_what_to_fix(raw: str) -> None:
    result = run_inline("echo", raw, ctx(), ("echo",))
    assert result.startswith("error: the arguments of tool 'echo' ")
    assert "send the call again with the arguments as one JSON object" in result
    assert '"text"' in result  # the parameters it takes


def test_empty_arguments_of_a_tool_without_required_parameters_are_no_arguments(scratch: list[str]) -> None:
    @tool
    def now_please() -> str:
        return "12:00"

    scratch.append("now_please")
    assert run_inline("now_please", "", ctx(), ("now_please",)) == "12:00"
    assert run_inline("echo", " ", ctx(), ("echo",)).startswith("error: the arguments of tool 'echo' are empty: ")


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_max_retries_must_be_an_integer_of_0_or_more(bad: Any) -> None:
    from harness.tools.registry import ToolDefinitionError

    def fussy() -> str:
        return ""

    with pytest.raises(ToolDefinitionError, match="max_retries must be an integer >= 0"):
        tool(max_retries=bad)(fussy)


def _round(name: str, result: str, call_id: str = "c1") -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{"}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def test_a_tools_count_skips_rounds_that_do_not_call_it_and_starts_again_at_a_user_message() -> None:
    from harness.arguments import rejected_rounds

    bad = "error: the arguments of tool 'echo' are not valid JSON (x at character 3): send it again"
    invalid = "error: invalid arguments for tool 'echo': text: Field required"
    other = _round("wait", "waited")
    messages = [*_round("echo", bad), *other, *_round("echo", invalid)]
    assert rejected_rounds(messages) == {"echo": (2, "invalid arguments for tool 'echo'")}
    assert rejected_rounds([*messages, *_round("echo", "hello")]) == {}
    assert rejected_rounds([*messages, {"role": "user", "content": "again"}, *_round("echo", bad)]) == {
        "echo": (1, "the arguments of tool 'echo' are not valid JSON")
    }
