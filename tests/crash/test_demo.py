"""`make demo` end to end on the embedded default (SQLite + filesystem broker, no server):
the code paths PostgreSQL does not need (SQLite engine, no advisory lock, filesystem
transport, its SQLite result backend) are exercised by a real SIGKILL and recovery."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = [pytest.mark.crash, pytest.mark.timeout(240)]


def test_demo_passes_on_the_embedded_default(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
    }
    env["DEMO_DIR"] = str(tmp_path / "demo")
    proc = subprocess.run(
        [sys.executable, "-m", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=220
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "backend: embedded" in out
    assert "recovery reused the SAME executions and child sessions" in out
    assert "invariant check I1–I5 over the whole database: all hold" in out
    assert out.count("TOOL from child session") == 2
    assert out.rstrip().endswith("demo passed")


def test_the_approval_demo_shows_a_request_a_kill_a_cli_decision_and_one_run(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
    }
    env["DEMO_DIR"] = str(tmp_path / "demo")
    proc = subprocess.run(
        [sys.executable, "-m", "demo", "approval"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=220
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "is WAITING_APPROVAL; refunds so far: 0" in out
    assert "approved by demo-operator: customer called" in out
    assert "a conflicting `deny` afterwards exits 1" in out
    assert "the refund ran 1 time(s)" in out
    assert out.rstrip().endswith("approval demo passed")
