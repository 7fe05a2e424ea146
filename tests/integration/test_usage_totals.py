"""Usage totals of a session (its own model calls) and of a tree (a session and all its
descendants), read from model_call_usage with one query each and shown by `session show`
(docs/usage.md). Real PostgreSQL, the scripted model over HTTP reporting known usage."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cli.main import main
from harness.parent import run_agent
from harness.views import create_session
from models import transaction
from models.usage import UsageTotals, session_usage, tree_usage
from tests.helpers import drive, executions_of, loop_deps
from tests.types import ModelFactory

pytestmark = pytest.mark.usefixtures("db", "redis_url")

MAIN = "main agent"


def _usage(prompt: int, completion: int, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


SCRIPT: list[dict[str, Any]] = [
    {
        "when": {"system_contains": MAIN, "turn": 0},
        "reply": {
            "tool_calls": [
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "one"}},
                {"name": "delegate", "arguments": {"agent_type": "reviewer", "task": "two"}},
            ],
            "usage": _usage(101, 11, cached=40, reasoning=3),
        },
    },
    {"when": {"system_contains": MAIN, "turn": 1}, "reply": {"content": "done", "usage": _usage(203, 13, 7, 2)}},
    {"when": {"system_contains": "reviewer subagent"}, "reply": {"content": "seen", "usage": _usage(57, 5, 0, 1)}},
]


def _served(journal: list[dict[str, Any]], rules: list[int] | None = None) -> UsageTotals:
    """What the scripted model served, summed over its answered requests (of ``rules`` only)."""
    picked = [SCRIPT[e["rule"]]["reply"]["usage"] for e in journal if rules is None or e["rule"] in rules]
    return UsageTotals(
        prompt_tokens=sum(u["prompt_tokens"] for u in picked),
        completion_tokens=sum(u["completion_tokens"] for u in picked),
        cached_tokens=sum(u["prompt_tokens_details"]["cached_tokens"] for u in picked),
        reasoning_tokens=sum(u["completion_tokens_details"]["reasoning_tokens"] for u in picked),
        model_calls=len(picked),
    )


def test_the_tree_total_is_what_the_model_served_and_the_session_total_the_parents_own(
    model_factory: ModelFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_factory(SCRIPT)
    deps = loop_deps(model.base_url)
    sid = create_session("main", "go")
    assert run_agent(sid, 0, deps) == "yielded"
    drive(model.base_url, after_crash=False, deps=deps)
    children = [e.child_session_id for e in executions_of(sid)]
    journal = model.journal()
    assert len(children) == 2 and len(journal) == 4

    with transaction() as s:
        tree, own = tree_usage(s, sid), session_usage(s, sid)
        child_trees = [tree_usage(s, c) for c in children]
    assert tree == _served(journal)
    assert own == _served(journal, rules=[0, 1]) == UsageTotals(304, 24, 47, 5, 2)
    assert child_trees == [UsageTotals(57, 5, 0, 1, 1)] * 2  # a leaf's tree is itself

    capsys.readouterr()
    assert main(["session", "show", str(sid), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["usage"] == {"session": own.as_dict(), "tree": tree.as_dict()}
    assert shown["id"] == sid and len(shown["executions"]) == 2  # the existing keys stay
    assert shown["budget"] is None  # no budget for this tree
    assert main(["session", "show", str(sid)]) == 0
    out = capsys.readouterr().out
    assert "usage: session prompt=304 completion=24 cached=47 reasoning=5 calls=2; tree prompt=418 " in out


def test_a_session_with_no_model_call_totals_zero() -> None:
    sid = create_session("main", "go")
    with transaction() as s:
        assert session_usage(s, sid) == tree_usage(s, sid) == UsageTotals(0, 0, 0, 0, 0)


def test_the_usage_command_groups_totals_by_agent_user_and_model_since_a_time(
    model_factory: ModelFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_factory(SCRIPT)
    deps = loop_deps(model.base_url)
    sid = create_session("main", "go", user_id="ada")
    assert run_agent(sid, 0, deps) == "yielded"
    drive(model.base_url, after_crash=False, deps=deps)
    journal = model.journal()
    everything, parent, children = _served(journal), _served(journal, [0, 1]), _served(journal, [2])

    def usage(*argv: str) -> dict[str, Any]:
        capsys.readouterr()
        assert main(["usage", *argv, "--json"]) == 0
        shown: dict[str, Any] = json.loads(capsys.readouterr().out)
        return shown

    by_agent = usage()  # by agent unless told
    assert by_agent["by"] == "agent" and by_agent["since"] is None
    assert by_agent["groups"] == [{"key": "main", **parent.as_dict()}, {"key": "reviewer", **children.as_dict()}]
    assert by_agent["total"] == everything.as_dict()
    assert usage("--by", "user")["groups"] == [{"key": "ada", **everything.as_dict()}]
    assert usage("--by", "model")["groups"] == [{"key": "scripted", **everything.as_dict()}]
    later = usage("--since", "2999-01-01T00:00:00+00:00")
    assert later["groups"] == [] and later["total"] == UsageTotals().as_dict()
    assert usage("--since", "2000-01-01")["total"] == everything.as_dict()  # a naive time is UTC

    assert main(["usage", "--by", "model"]) == 0
    out = capsys.readouterr().out
    assert "scripted" in out and f"prompt={everything.prompt_tokens} " in out
    with pytest.raises(SystemExit) as bad:  # not an ISO time: a usage error, as argparse reports one
        main(["usage", "--since", "yesterday"])
    assert bad.value.code == 2 and "--since" in capsys.readouterr().err
