"""The warm-up of each pool process (models.warmup): what it compiles reaches no database, a
stale entry costs nothing but its own speed, and the recorded list still covers what a crash's
recovery and a delivery-only recovery run in real workers.

``WRITE_WARM_SHAPES=1 pytest tests/integration/test_warmup.py`` rewrites
``models/warm_shapes.json`` from what the last test records (after a change to a statement, a
builder's arguments or the parameters a call passes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, exc, text

from models.warmup import SHAPES_FILE, compile_hot_statements, load_shapes, shape_key, write_shapes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def booted() -> Any:
    """This process as a booted worker: the shapes written with the worker's identity need one."""
    from models import worker

    before = worker.identity()
    worker.set_identity("warm-up-test@host", 7)
    yield
    worker._identity = before


def test_the_list_is_there_and_every_entry_compiles_without_a_statement_reaching_the_database(
    db: str, booted: None
) -> None:
    from models.db import get_engine

    shapes = load_shapes()
    assert len(shapes) >= 30, f"{SHAPES_FILE} lists {len(shapes)} statements"
    from models.base import utcnow

    engine = get_engine(db)
    engine.dispose()  # one pooled connection from here on: the warm-up's sessions reuse it
    utcnow()  # the process's measure of the database's clock, taken now (an INSERT's default reads it)
    with engine.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        conn.commit()  # the backend's last statement: COMMIT
    opened: list[object] = []
    listener = lambda *_: opened.append(1)  # noqa: E731 - the engine's "connect" event
    event.listen(engine, "connect", listener)
    try:
        done = compile_hot_statements(engine, shapes)
    finally:
        event.remove(engine, "connect", listener)
    admin = create_engine(db)
    try:
        with admin.connect() as conn:
            last = conn.execute(text("SELECT query FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}).scalar_one()
    finally:
        admin.dispose()
    assert done["compiled"] == len(shapes) and done["skipped"] == 0, done
    # The backend's last statement is still our COMMIT, or the pool's ping (SELECT 1 after half a
    # second idle): none of the warm-up's statements was sent (nor a ROLLBACK after one), and it
    # opened no connection (counted by this engine: other processes' connections to the test
    # database come and go meanwhile).
    assert last in ("COMMIT", "SELECT 1"), last
    assert not opened, f"the warm-up opened {len(opened)} connections"


def test_an_entry_that_no_longer_fits_the_code_is_skipped_and_the_rest_compiles(db: str, booted: None) -> None:
    from models.db import get_engine

    good = load_shapes()[:3]
    stale = [
        {**good[0], "builder": "models.session:_a_builder_that_was_removed"},
        {**good[0], "args": [*good[0]["args"], "an argument too many"]},
        {**good[0], "builder": "models.no_such_module:_stmt"},
    ]
    done = compile_hot_statements(get_engine(db), [*stale, *good])
    assert (done["compiled"], done["skipped"]) == (3, 3), done


def test_without_a_database_the_warm_up_ends_at_its_first_statement(booted: None) -> None:
    nowhere = create_engine("postgresql+psycopg2://postgres@127.0.0.1:1/nowhere")
    try:
        with pytest.raises(exc.OperationalError):
            compile_hot_statements(nowhere, load_shapes()[:5])
    finally:
        nowhere.dispose()


def _numbers_in(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return True
    if isinstance(value, dict):
        return any(_numbers_in(v) for v in value.values())
    if isinstance(value, list):
        return any(_numbers_in(v) for v in value)
    return False


def _by_builder(shape: dict[str, Any]) -> tuple[str, Any]:
    return shape["builder"], shape["index"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_crash_and_a_delivery_only_recovery_run_only_statements_the_warm_up_compiled(tmp_path: Path) -> None:
    """Real workers (``bench/recovery.py``, tiny sizes) with ``tests/shape_recorder.py`` in them:
    a task that began after its process's warm-up ended finds every listed statement compiled,
    and every built statement the tasks ran is listed. A statement built per count (a builder
    with a number among its arguments: how many executions a delivery marks) is listed by its
    builder: the counts a run meets depend on its timing."""
    out = tmp_path / "shapes.jsonl"
    env = {
        **os.environ,
        "BENCH_REDIS_URL": os.environ["STACK_REDIS_URL"],
        "BENCH_REDIS_DBS": os.environ["STACK_REDIS_DBS"],
        "BENCH_SETTLE_SECONDS": "0",
        "TOOL_MODULES": "tests.shape_recorder",
        "SHAPE_RECORDER_OUT": str(out),
    }
    for mode in ([], ["--delivered-only"]):
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "recovery.py"), "--parents", "4", "--children", "3", "--runs", "1",
             "--ceiling-seconds", "0.3", *mode],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=200,
        )  # fmt: skip
        failed = f"bench/recovery.py {mode} exited {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
        assert done.returncode == 0, failed
        assert "invariants I1-I5: ok" in done.stdout

    lines = [json.loads(line) for line in out.read_text().splitlines()]
    ran = {line["task"] for line in lines}
    assert {"recovery.recover_children", "agent.deliver_rounds", "recovery.scan"} <= ran, ran
    if os.environ.get("WRITE_WARM_SHAPES") == "1":
        write_shapes(line["shape"] for line in lines)
    listed = {shape_key(s) for s in load_shapes()}
    listed_builders = {_by_builder(s) for s in load_shapes()}

    compiled_there = [
        line for line in lines if line["warmed"] and line["generated"] and shape_key(line["shape"]) in listed
    ]
    assert not compiled_there, (
        f"{len(compiled_there)} listed statements were compiled inside a task after the warm-up, e.g. "
        f"{compiled_there[0]['task']}: {compiled_there[0]['shape']}"
    )
    assert any(line["warmed"] for line in lines), "no task began after its process's warm-up ended"
    missing = {
        shape_key(line["shape"])
        for line in lines
        if shape_key(line["shape"]) not in listed
        and not (_numbers_in(line["shape"]["args"]) and _by_builder(line["shape"]) in listed_builders)
    }
    assert not missing, (
        f"{len(missing)} statements the tasks ran are not in {SHAPES_FILE.name} (rewrite it: WRITE_WARM_SHAPES=1 "
        f"pytest {Path(__file__).relative_to(ROOT)}), e.g. {sorted(missing)[0]}"
    )
