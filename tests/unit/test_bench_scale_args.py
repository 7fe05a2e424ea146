"""bench/scale.py's load shape on its command line: the model's latency, the pool, the kinds,
the kill at half-way."""

from __future__ import annotations

import pytest

from bench.scale import _script, parse_args, workers_shape


def test_a_fixed_model_latency_delays_every_scripted_reply() -> None:
    args = parse_args(["--model-latency", "1.5", "--pool", "threads", "--concurrency", "64", "--kinds", "ours"])
    assert (args.latencies, args.pool, args.concurrency, args.kinds) == ([("1.5", 1.5)], "threads", 64, ["ours"])
    assert {rule["delay_seconds"] for rule in _script(3, args.latencies[0][1])} == {1.5}


def test_several_fixed_model_latencies_run_the_whole_load_at_each() -> None:
    args = parse_args(["--model-latency", "0,1,2,5", "--pool", "threads"])
    assert args.latencies == [("0", 0.0), ("1", 1.0), ("2", 2.0), ("5", 5.0)]


def test_the_kill_at_half_way_runs_on_ours_alone() -> None:
    assert parse_args(["--kinds", "ours", "--kill-at-half"]).kill_at_half
    with pytest.raises(SystemExit):
        parse_args(["--kill-at-half"])  # the naive baseline has no recovery: a kill loses its parents


def test_gevent_is_a_pool_the_bench_can_measure() -> None:
    assert parse_args(["--pool", "gevent"]).pool == "gevent"


def test_a_lognormal_model_latency_is_the_scripted_models_distribution() -> None:
    args = parse_args(["--model-latency", "lognormal:2,0.5"])
    assert args.latencies == [("lognormal:2,0.5", {"lognormal": [2.0, 0.5]})]
    assert all(rule["delay_seconds"] == {"lognormal": [2.0, 0.5]} for rule in _script(3, args.latencies[0][1]))


def test_an_instant_model_adds_no_delay() -> None:
    assert all("delay_seconds" not in rule for rule in _script(3, parse_args([]).latencies[0][1]))


@pytest.mark.parametrize(
    "argv",
    [
        ["--model-latency", "-1"],
        ["--model-latency", "soon"],
        ["--model-latency", "lognormal:1"],
        ["--model-latency", "lognormal:1,-0.5"],
        ["--pool", "eventlet"],
        ["--model-latency", "1,soon"],
        ["--model-latency", ","],
        ["--kinds", "theirs"],
    ],
)
def test_a_bad_load_shape_is_a_clear_argument_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_the_procfile_topology_runs_ours_once_on_the_procfiles_pools() -> None:
    args = parse_args(["--topology", "procfile", "--kinds", "ours"])
    assert (args.workers, args.pool, args.concurrency) == ([1], "threads", None)  # None: the Procfile's -c
    assert "-P threads -c 256 -Q celery" in workers_shape(args) and "-Q recovery" in workers_shape(args)
    assert parse_args(["--topology", "procfile", "--kinds", "ours", "--concurrency", "128"]).concurrency == 128
    assert (parse_args([]).workers, parse_args([]).pool, parse_args([]).concurrency) == ([1, 2, 4], "prefork", 1)


@pytest.mark.parametrize(
    "argv",
    [
        ["--topology", "procfile"],  # the naive baseline has no recovery queue
        ["--topology", "procfile", "--kinds", "ours", "--pool", "prefork"],  # the Procfile names the pools
        ["--topology", "procfile", "--kinds", "ours", "--workers", "2"],  # one pair: names would clash
    ],
)
def test_the_procfile_topology_refuses_what_it_cannot_run_as_written(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
