"""bench/soak.py stopped by SIGTERM (a timeout) or SIGINT stops every process it started: its
workers run in sessions of their own, so a signal sent to the soak alone never reaches them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devstack.processes import ROOT
from tests.helpers import wait_until

pytestmark = [pytest.mark.crash, pytest.mark.timeout(240)]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:100]
        return f"state={fields[0]} ppid={fields[1]} pgid={fields[2]} {cmd}"
    except OSError:
        return "?"


def _celery(pid: int) -> bool:
    try:
        return b"celery" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_soak_stopped_by_a_signal_mid_trial_leaves_none_of_its_processes_running(tmp_path: Path, signum: int) -> None:
    env = {**os.environ, "STACK_REDIS_DBS": "1,2,3"}
    out = (tmp_path / "soak.out").open("wb")
    soak = subprocess.Popen(
        [sys.executable, "bench/soak.py", "--trials", "3", "--workers", "2", "--faults", "stall"],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    started: set[int] = set()
    try:

        def workers_up() -> bool:
            started.update(_descendants(soak.pid))
            return sum(_celery(p) for p in started) >= 2

        wait_until(workers_up, timeout=120, interval=0.5, what="the soak's workers started")
        time.sleep(3)  # inside the trial (the stall fault holds a worker stopped for 2-3 leases)
        started.update(_descendants(soak.pid))
        soak.send_signal(signum)
        soak.wait(90)
        deadline = time.monotonic() + 30
        while [p for p in started if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [f"{p} {_cmdline(p)}" for p in started if _alive(p)]
        assert not left, f"left running: {left}"
    finally:
        for pid in started:  # never leave a run's leftovers behind (the old soak did)
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if soak.poll() is None:
            soak.kill()
            soak.wait(10)
        out.close()
    assert soak.returncode == 128 + signum, (tmp_path / "soak.out").read_text()[-2000:]
