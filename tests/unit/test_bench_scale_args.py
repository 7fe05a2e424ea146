"""bench/scale.py's load shape on its command line: the model's latency, the pool, the kinds."""

from __future__ import annotations

import pytest

from bench.scale import _script, parse_args


def test_a_fixed_model_latency_delays_every_scripted_reply() -> None:
    args = parse_args(["--model-latency", "1.5", "--pool", "threads", "--concurrency", "64", "--kinds", "ours"])
    assert (args.latency, args.pool, args.concurrency, args.kinds) == (1.5, "threads", 64, ["ours"])
    assert {rule["delay_seconds"] for rule in _script(3, args.latency)} == {1.5}


def test_a_lognormal_model_latency_is_the_scripted_models_distribution() -> None:
    args = parse_args(["--model-latency", "lognormal:2,0.5"])
    assert args.latency == {"lognormal": [2.0, 0.5]}
    assert all(rule["delay_seconds"] == {"lognormal": [2.0, 0.5]} for rule in _script(3, args.latency))


def test_an_instant_model_adds_no_delay() -> None:
    assert all("delay_seconds" not in rule for rule in _script(3, parse_args([]).latency))


@pytest.mark.parametrize(
    "argv",
    [
        ["--model-latency", "-1"],
        ["--model-latency", "soon"],
        ["--model-latency", "lognormal:1"],
        ["--model-latency", "lognormal:1,-0.5"],
        ["--pool", "gevent"],
        ["--kinds", "theirs"],
    ],
)
def test_a_bad_load_shape_is_a_clear_argument_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
