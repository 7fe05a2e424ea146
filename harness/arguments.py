"""Tool-call arguments the model got wrong: how many rounds in a row, per tool, and the bound
(docs/tools.md, "Arguments the model got wrong").

A call whose arguments are not a JSON object, are empty while the tool requires parameters, or
do not validate is answered with a TOOL error that says what to fix (harness.tools.registry),
and the loop goes on. The model may do so for one tool in at most ``max_retries`` rounds in a
row (``@tool(max_retries=N)``, else TOOL_MAX_RETRIES); the loop checks before it asks the
model again and, one round past the bound, ends the session FAILED with the reason
``tool_arguments`` (``ToolArgumentsRejected``).

The count is read from the messages the model is about to be sent (the stored history), never
kept in the process: a loop recovered after a crash counts the rounds its predecessor
committed. A tool's count is the rounds since the last USER message in which every call of it
was refused for its arguments, counted back to the last round in which a call of it had
arguments it could take; a round that does not call it leaves its count as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harness.errors import ToolArgumentsRejected
from harness.tools import lookup
from harness.tools.registry import is_argument_error


def rejected_rounds(messages: Sequence[dict[str, Any]]) -> dict[str, tuple[int, str]]:
    """Tool name -> (rounds in a row its arguments were refused, the last refusal's summary),
    for the tools whose count is not 0, from chat-completions ``messages`` in order."""
    counts: dict[str, tuple[int, str]] = {}
    names: dict[str, str] = {}  # the current round's call id -> tool name
    refused: dict[str, str] = {}
    took: set[str] = set()

    def end_round() -> None:
        for name in took:
            counts.pop(name, None)
        for name, summary in refused.items():
            if name not in took:
                counts[name] = (counts.get(name, (0, ""))[0] + 1, summary)
        names.clear()
        refused.clear()
        took.clear()

    for message in messages:
        role = message.get("role")
        if role == "tool":
            name = names.get(str(message.get("tool_call_id")))
            content = message.get("content")
            if name is None:
                continue
            if isinstance(content, str) and is_argument_error(content):
                refused[name] = _summary(content)
            else:
                took.add(name)
            continue
        end_round()
        if role == "user":
            counts.clear()
        elif role == "assistant":
            for call in message.get("tool_calls") or ():
                function = call.get("function") or {}
                names[str(call.get("id"))] = str(function.get("name"))
    end_round()
    return counts


def check(messages: Sequence[dict[str, Any]]) -> None:
    """Raise ``ToolArgumentsRejected`` when a tool's arguments were refused in more rounds in a
    row than its ``max_retries``; the message names the tool and the bound, never the arguments."""
    for name, (rounds, summary) in sorted(rejected_rounds(messages).items()):
        bound = max_retries(name)
        if rounds > bound:
            raise ToolArgumentsRejected(
                f"the model sent arguments tool {name!r} could not take in {rounds} rounds in a row "
                f"(max_retries={bound}): {summary}"
            )


def max_retries(name: str) -> int:
    """The tool's ``max_retries``; TOOL_MAX_RETRIES for an MCP tool, a tool that says nothing,
    and a tool this process does not have any more."""
    from settings import get_settings

    found = lookup(name)
    if found is not None and found.max_retries is not None:
        return found.max_retries
    return get_settings().TOOL_MAX_RETRIES


def _summary(result: str) -> str:
    """``the arguments of tool 'echo' are not valid JSON`` of a refusal: what was wrong, without
    the parser's detail, the fields or the parameters (never a value the model sent)."""
    text = result.removeprefix("error: ")
    cut = min((i for i in (text.find(" ("), text.find(":")) if i >= 0), default=len(text))
    return text[:cut]
