"""README's "Your first agent in five minutes", run as written: its shell blocks, in order, in a
fresh folder, against this test's PostgreSQL and Redis (the variables a reader would leave at
their defaults are the only thing changed, and the scripted model's port). A walk-through that
stops working fails here."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from models import Role
from tests.helpers import invariants, messages_of

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Your first agent in five minutes"

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]


def walk_through() -> str:
    """The section's ```sh blocks joined, as a reader would paste them one after another."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    blocks = re.findall(r"```sh\n(.*?)```", readme[start:end], flags=re.S)
    assert len(blocks) >= 4, "the walk-through lost its shell blocks"
    return "\n".join(blocks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_readmes_first_agent_runs_is_killed_mid_tool_and_recovers_with_one_key(db: str, tmp_path: Path) -> None:
    from devstack.processes import flush_broker

    flush_broker()
    port = _free_port()
    script = walk_through().replace("--port 8765", f"--port {port}")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # `. .venv/bin/activate` as in a clone
    env = dict(os.environ)
    env.update(DATABASE_URL=db, MODEL_BASE_URL=f"http://127.0.0.1:{port}/v1", CRASH_POINT="")
    for key in ("TOOL_MODULES", "AGENTS_FILE", "PYTHONPATH", "LEASE_SECONDS", "SCAN_INTERVAL_SECONDS"):
        env.pop(key, None)
    cleanup = 'trap \'pkill -9 -P "$WORKER" 2>/dev/null; kill -9 "$WORKER" "$MODEL" 2>/dev/null\' EXIT\n'
    proc = subprocess.run(
        ["bash", "-c", "set -eo pipefail\n" + cleanup + script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in (tmp_path / "shop").glob("*.log"))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    sid = int(re.search(r"^session (\d+)$", proc.stdout, flags=re.M).group(1))  # type: ignore[union-attr]

    roles = [m.role for m in messages_of(sid)]
    assert roles == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    answer = messages_of(sid)[-1].content or ""
    assert answer.startswith("Order 7:") and "shipped" in answer
    runs = (tmp_path / "shop" / "calls.log").read_text().split()
    # Two starts (the first killed mid-call), one idempotency key, the same order.
    assert len(runs) == 4 and runs[0] == runs[2] and runs[1] == runs[3] == "7", runs
    assert invariants() == []
