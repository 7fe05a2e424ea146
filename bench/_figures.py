"""How every benchmark reports: the machine's load beside each figure, medians of runs."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence


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
