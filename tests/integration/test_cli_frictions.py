"""What a newcomer meets first at the command line: commands that run no tool need none of the
workers' tool modules, and a wait that ends at an approval says what to approve and how."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.main import main
from models import ApprovalRequest, transaction
from tests.integration.test_approvals import call, parent_script, parked_parent, runs  # noqa: F401 (fixture)
from tests.types import ModelFactory

UNLOADED = """
[agents.shop]
system_prompt = "You are the shop agent."
tools = ["lookup_order"]
"""


@pytest.fixture
def workers_agents_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The workers' AGENTS_FILE, in a shell that lacks their TOOL_MODULES."""
    from harness.agents import _load
    from settings import get_settings

    agents = tmp_path / "agents.toml"
    agents.write_text(UNLOADED, encoding="utf-8")
    monkeypatch.setenv("AGENTS_FILE", str(agents))
    monkeypatch.delenv("TOOL_MODULES", raising=False)
    get_settings.cache_clear()
    _load.cache_clear()
    yield
    monkeypatch.undo()
    get_settings.cache_clear()
    _load.cache_clear()


@pytest.mark.parametrize("argv", [["approvals"], ["approvals", "--json"], ["session", "list"]])
def test_commands_that_run_no_tool_work_without_the_workers_tool_modules(
    db: str, workers_agents_file: None, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 0, capsys.readouterr().err


def test_submit_still_checks_the_agents_tools_and_says_which_one_is_missing(
    db: str, workers_agents_file: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["submit", "--agent", "shop", "hello"]) == 2
    assert "lookup_order" in capsys.readouterr().err


@pytest.mark.usefixtures("runs")
def test_a_wait_that_ends_at_an_approval_names_each_waiting_call_and_the_commands_that_decide_it(
    model_factory: ModelFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_factory(parent_script(call("refund", order="A-1", amount=30)))
    sid, _deps = parked_parent(model.base_url)
    with transaction() as s:
        (call_id,) = s.query(ApprovalRequest.call_id).filter(ApprovalRequest.session_id == sid).one()

    assert main(["session", "wait", str(sid), "--timeout", "2"]) == 0
    err = capsys.readouterr().err
    assert f"session {sid} phase=WAITING_APPROVAL" in err
    assert f"call {call_id} tool refund" in err
    assert f"agent-recovery approve {sid} {call_id} --by NAME" in err
    assert f"agent-recovery deny {sid} {call_id} --reason TEXT" in err


def test_a_wait_on_a_session_that_does_not_exist_says_so(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["session", "wait", "999999", "--timeout", "0.1"]) == 1
    assert "no session 999999" in capsys.readouterr().err
