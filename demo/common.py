"""What both demos share: where their data lives, how they configure the backends, how they
wait and report. `demo/__main__.py` (the delegation demo) and `demo/approval.py` (the approval
demo) both import it; neither imports the other's module at its top."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("DEMO_DIR", ROOT / "demo-data"))


class DemoFailed(Exception):
    pass


def say(text: str) -> None:
    print(text, flush=True)


def configure() -> str:
    """Environment for this process and the workers; returns a description of the backend."""
    embedded = not (os.environ.get("DATABASE_URL") and os.environ.get("CELERY_BROKER_URL"))
    if DATA.exists():
        shutil.rmtree(DATA)
    DATA.mkdir(parents=True)
    if embedded:
        os.environ["DATABASE_URL"] = f"sqlite:///{DATA / 'state.db'}"
        os.environ["CELERY_BROKER_URL"] = "filesystem://"
        os.environ["CELERY_FS_FOLDER"] = str(DATA / "broker")
        os.environ["CELERY_RESULT_BACKEND"] = f"db+sqlite:///{DATA / 'results.db'}"
        os.environ["REDIS_URL"] = "none://"  # no session_status events without a Redis
        for sub in ("out", "processed"):
            (DATA / "broker" / sub).mkdir(parents=True)
    os.environ.setdefault("LEASE_SECONDS", "3")
    os.environ.setdefault("SCAN_INTERVAL_SECONDS", "2")
    os.environ["CRASH_POINT"] = ""
    os.environ["PYTHONPATH"] = str(ROOT)
    return "embedded (SQLite + filesystem broker)" if embedded else "PostgreSQL + Redis from the environment"


def wait_for(what: str, predicate: Callable[[], Any], timeout: float) -> Any:
    start = time.monotonic()
    last = -10.0
    while True:
        value = predicate()
        if value:
            return value
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            raise DemoFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        if elapsed - last >= 2:
            say(f"  … waiting for {what} ({elapsed:.0f}s)")
            last = elapsed
        time.sleep(0.2)
