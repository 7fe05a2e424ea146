"""How every benchmark reports: the machine's load beside each figure, medians of runs."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Sequence


def system_load() -> str:
    """``load average 0.42, 0.31, 0.13 (2 cores)``: printed beside each figure, because the
    development machine is shared and the figures move with its load."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} ({os.cpu_count()} cores)"


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def spread(values: Sequence[float], scale: float = 1.0, unit: str = "") -> str:
    """``min .. max`` of the runs, for a line that prints their median."""
    return f"{min(values) * scale:.1f}{unit} .. {max(values) * scale:.1f}{unit}"


def loads(text: str) -> list[int]:
    """``--parents`` of the benches that compare at several loads: ``20`` or ``20,50,100``
    (argparse ``type``: a clear error for anything else)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or comma-separated counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every count must be at least 1, got {text!r}")
    return values


def run_by_load(
    args: argparse.Namespace, measure: Callable[[argparse.Namespace], tuple[int, dict[str, float]]], what: str
) -> int:
    """``measure`` (a whole bench at ``args.parents`` parents, returning its exit status and its
    figures by name) at each of ``args.parents`` counts, then :func:`print_by_load`; the worst
    exit status."""
    code, by_load = 0, []
    for parents in args.parents:
        status, found = measure(argparse.Namespace(**{**vars(args), "parents": parents}))
        code = max(code, status)
        by_load.append((parents, found))
    print_by_load(by_load, what)
    return code


def print_by_load(figures: Sequence[tuple[int, dict[str, float]]], what: str) -> None:
    """After a bench ran at several loads (``--parents 20,50,100``): its ratios side by side,
    one line per figure, so that how they move with load reads at a glance."""
    if len(figures) < 2:
        return
    names = list(dict.fromkeys(name for _, row in figures for name in row))
    print(f"by load ({what}; the medians printed above, at each count of parents):")
    for name in names:
        cells = ", ".join(f"{parents}: {_figure(row[name])}" for parents, row in figures if name in row)
        print(f"  {name}: {cells}")


def _figure(value: float) -> str:
    """3 significant digits below 1 (a ratio to the ceiling), 2 decimals up to 100, whole above."""
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
