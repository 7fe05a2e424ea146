"""bench/peer_dbos.py's normal path on a model with latency: both sides' scripted model waits the
same seconds a reply, and our worker's pool is the caller's."""

from __future__ import annotations

import pytest

from bench.delegation import instant_script
from bench.peer_dbos import NormalFigures, delayed, parse_args


def test_a_model_latency_delays_every_reply_of_both_sides_and_the_pool_is_ours_to_choose() -> None:
    args = parse_args(["--modes", "normal", "--model-latency", "2", "--pool", "threads", "--concurrency", "64"])
    assert (args.model_latency, args.pool, args.concurrency) == (2.0, "threads", 64)
    assert {rule["delay_seconds"] for rule in delayed(instant_script(3), args.model_latency)} == {2.0}


def test_an_instant_model_and_prefork_stay_the_defaults() -> None:
    args = parse_args([])
    assert (args.model_latency, args.pool) == (0.0, "prefork")
    assert all("delay_seconds" not in rule for rule in delayed(instant_script(3), args.model_latency))


@pytest.mark.parametrize("argv", [["--model-latency", "-1"], ["--pool", "gevent"]])
def test_a_negative_latency_or_an_unknown_pool_is_an_argument_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_the_procfile_topology_runs_ours_on_the_procfiles_pools() -> None:
    args = parse_args(["--modes", "normal", "--topology", "procfile", "--concurrency", "128"])
    assert (args.topology, args.pool, args.concurrency) == ("procfile", "threads", 128)
    with pytest.raises(SystemExit):
        parse_args(["--topology", "procfile", "--pool", "prefork"])


def test_the_normal_paths_figures_say_where_the_cpu_went_a_parent() -> None:
    figures = NormalFigures(10, 2.0, [], cpu_s=0.5, all_mb=100.0, server_cpu_s=0.3, bench_cpu_s=0.1)
    assert figures.parents_per_second == 5.0
    assert figures.cpu_note() == (
        "CPU ms a parent: workers 50, PostgreSQL+Redis 30, bench (model stand-in, submission, polling) 10"
    )
    assert "PostgreSQL+Redis -" in NormalFigures(10, 2.0, []).cpu_note()  # servers not local: not measured


def test_dboss_own_connection_pools_stay_unless_the_caller_sizes_them() -> None:
    assert parse_args(["--modes", "normal"]).dbos_pool_size == 0  # 0: DBOS's defaults, as before
    assert parse_args(["--modes", "normal", "--dbos-pool-size", "64"]).dbos_pool_size == 64
