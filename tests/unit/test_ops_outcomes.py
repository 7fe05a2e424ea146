"""What an operator's redelivery ends in: enum members whose values are the public spellings
(`agent-recovery redeliver` prints them, `recovery.redeliver*` return them)."""

from __future__ import annotations

import ast
import inspect

from recovery import ops
from recovery.ops import RedeliverOutcome


def test_redelivery_outcomes_keep_the_spellings_the_cli_prints() -> None:
    assert RedeliverOutcome.NOTHING_PENDING == "nothing_pending"
    assert RedeliverOutcome.STILL_RUNNING == "still_running"
    assert str(RedeliverOutcome.NOTHING_PENDING) == "nothing_pending"  # what `print(outcome)` writes


def test_no_operator_action_returns_or_logs_a_bare_string_outcome() -> None:
    tree = ast.parse(inspect.getsource(ops))
    bare = [
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str))
        or (isinstance(node, ast.keyword) and node.arg == "outcome" and isinstance(node.value, ast.Constant))
    ]
    assert bare == [], f"recovery/ops.py lines {bare}: name the outcome in RedeliverOutcome"
