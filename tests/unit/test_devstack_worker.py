"""devstack's Worker starts a queue's worker as the Procfile does unless told otherwise: the demo,
the soak and the benches run the agent loops on the pool production runs them on."""

from __future__ import annotations

from pathlib import Path

from devstack.processes import Worker, procfile_commands, procfile_workers


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


def test_the_procfile_topology_is_the_procfiles_worker_lines_verbatim(tmp_path: Path) -> None:
    lines = procfile_commands()
    workers = {w.name: w.cmd[1:] for w in procfile_workers({}, tmp_path)}
    assert workers == {name: argv for name, argv in lines.items() if "worker" in argv}
    assert set(workers) == {"worker", "recovery"}


def test_a_procfile_topology_at_another_size_changes_only_the_agent_loops_c(tmp_path: Path) -> None:
    lines = procfile_commands()
    workers = {w.name: w.cmd[1:] for w in procfile_workers({}, tmp_path, concurrency=256)}
    assert _pool_and_concurrency(workers["worker"]) == (_pool_and_concurrency(lines["worker"])[0], "256")
    c = lines["worker"].index("-c") + 1
    assert workers["worker"][:c] + workers["worker"][c + 1 :] == lines["worker"][:c] + lines["worker"][c + 1 :]
    assert workers["recovery"] == lines["recovery"]  # the recovery queue's prefork worker keeps its size


def test_a_procfile_line_without_c_or_q_serves_the_agent_loops(tmp_path: Path) -> None:
    procfile = tmp_path / "Procfile"
    procfile.write_text(
        "# a comment: not a line\nworker: celery -A tasks worker -P threads\nbeat: celery -A tasks beat\n"
    )
    (worker,) = procfile_workers({}, tmp_path, concurrency=8, path=procfile)
    assert worker.cmd[1:] == ["-A", "tasks", "worker", "-P", "threads", "-c", "8"]
