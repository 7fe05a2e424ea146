"""devstack's Worker starts a queue's worker as the Procfile does unless told otherwise: the demo,
the soak and the benches run the agent loops on the pool production runs them on."""

from __future__ import annotations

from pathlib import Path

from devstack.processes import Worker, procfile_commands


def _pool_and_concurrency(argv: list[str]) -> tuple[str, str]:
    return argv[argv.index("-P") + 1], argv[argv.index("-c") + 1]


def test_a_worker_started_without_a_pool_runs_as_the_procfiles_celery_queue_worker(tmp_path: Path) -> None:
    worker = Worker({}, tmp_path, name="w1")
    assert _pool_and_concurrency(worker.cmd) == _pool_and_concurrency(procfile_commands()["worker"])


def test_a_recovery_queue_worker_started_without_a_pool_runs_as_the_procfiles_recovery_worker(
    tmp_path: Path,
) -> None:
    worker = Worker({}, tmp_path, name="r1", queues="recovery")
    assert _pool_and_concurrency(worker.cmd) == _pool_and_concurrency(procfile_commands()["recovery"])


def test_a_pool_or_a_size_the_caller_names_is_kept(tmp_path: Path) -> None:
    assert _pool_and_concurrency(Worker({}, tmp_path, concurrency=2, pool="prefork").cmd) == ("prefork", "2")
    assert _pool_and_concurrency(Worker({}, tmp_path, pool="threads", concurrency=8).cmd) == ("threads", "8")
    assert _pool_and_concurrency(Worker({}, tmp_path, pool="prefork").cmd) == ("prefork", "2")
