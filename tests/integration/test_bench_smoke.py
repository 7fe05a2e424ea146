"""The benchmarks run with tiny sizes and print their figure lines, so they cannot rot.

Each one is a real subprocess (`python bench/NAME.py ...`) on its own throwaway database and
the benchmarks' own Redis databases; no figure is asserted, only that it is printed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "recovery": (
        ["--parents", "3", "--children", "2", "--ceiling-seconds", "0.5"],
        [
            "scan -> every parent resumed:",
            "deliveries/s:",
            "commit ceiling:",
            "ratio ours/ceiling:",
            "invariants I1-I5: ok",
        ],
    ),
    "scan": (
        ["--pending", "40", "--history", "5000", "--repeat", "1"],
        [
            "scan over 0 historic rows:",
            "scan over 5000 historic rows:",
            "ratio history/empty:",
            "plan uses idx_sae_pending: yes",
        ],
    ),
    "delegation": (
        ["--rounds", "2", "--warmup", "0"],
        [
            "ours, round commit -> parent resumed:",
            "bare chord, enqueue -> follow-up:",
            "ratio ours/bare",
            "invariants I1-I5: ok",
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs_with_tiny_sizes_and_prints_its_figures(name: str, pg_url: str, redis_url: str) -> None:
    args, lines = CASES[name]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = done.stdout
    assert done.returncode == 0, f"bench/{name}.py exited {done.returncode}\n{out}\n{done.stderr[-4000:]}"
    missing = [line for line in lines if line not in out]
    assert not missing, f"bench/{name}.py did not print {missing}\n{out}"
