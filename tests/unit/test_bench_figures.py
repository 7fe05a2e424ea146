"""bench/_figures.py: ``--parents`` at several loads, and the by-load lines printed after them."""

from __future__ import annotations

import argparse

import pytest

from bench._figures import loads, print_by_load


def test_parents_take_one_count_or_several() -> None:
    assert loads("20") == [20]
    assert loads("20,50,100") == [20, 50, 100]


@pytest.mark.parametrize("text", ["", "20,", "x", "20,0", "-3"])
def test_anything_else_is_a_clear_argument_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="count"):
        loads(text)


def test_the_benches_refuse_a_bad_count_on_their_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.peer_dbos import parse_args as peer_args
    from bench.recovery import parse_args as recovery_args

    assert recovery_args(["--parents", "20,100"]).parents == [20, 100]
    assert peer_args(["--parents", "5"]).parents == [5]
    with pytest.raises(SystemExit):
        recovery_args(["--parents", "20,zero"])
    assert "argument --parents: expected a count or comma-separated counts" in capsys.readouterr().err


def test_warm_pools_go_with_delivery_only(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.recovery import parse_args

    assert parse_args(["--delivered-only", "--warm"]).warm
    assert not parse_args(["--delivered-only"]).warm
    with pytest.raises(SystemExit):
        parse_args(["--warm"])
    assert "--warm goes with --delivered-only" in capsys.readouterr().err


def test_scan_steps_take_three_children_by_default_and_go_without_parents(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.scan import parse_args

    args = parse_args(["--steps", "20"])
    assert (args.steps, args.per_parent) == (20, 3)
    assert parse_args([]).steps == 0
    with pytest.raises(SystemExit):
        parse_args(["--steps", "20", "--parents", "100"])
    assert "--steps must be >= 0, and goes without --parents" in capsys.readouterr().err


def test_by_load_prints_each_figure_across_the_loads_and_nothing_for_one_load(
    capsys: pytest.CaptureFixture[str],
) -> None:
    print_by_load([(20, {"crash": 3.3})], "ours / DBOS")
    assert capsys.readouterr().out == ""
    rows = [(20, {"crash": 3.32, "restart": 0.55, "rate": 191.7}), (100, {"crash": 6.0, "restart": 0.1837})]
    print_by_load(rows, "ours / DBOS")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("by load (ours / DBOS;")
    assert out[1:] == ["  crash: 20: 3.32, 100: 6.00", "  restart: 20: 0.55, 100: 0.184", "  rate: 20: 192"]


def test_run_by_load_measures_each_count_and_returns_the_worst_status(capsys: pytest.CaptureFixture[str]) -> None:
    from bench._figures import run_by_load

    seen: list[int] = []

    def measure(args: argparse.Namespace) -> tuple[int, dict[str, float]]:
        seen.append(args.parents)
        return (1 if args.parents == 50 else 0), {"ratio": args.parents / 10}

    args = argparse.Namespace(parents=[20, 50, 100], trials=3)
    assert run_by_load(args, measure, "ours / x") == 1
    assert seen == [20, 50, 100] and args.parents == [20, 50, 100]  # the caller's args untouched
    assert "  ratio: 20: 2.00, 50: 5.00, 100: 10.00" in capsys.readouterr().out
