"""The PNGs of ``bench/scale.py``: latency and throughput against load (the README's plot,
``docs/img/scale.png``), and parents/s against the model's latency (``--model-latency 0,1,2,5``,
``docs/img/scale-latency.png``). Both need the ``bench`` extra's matplotlib; without it each
returns the line that says the plot was skipped."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.scale import Cell

OURS, NAIVE = "ours", "naive"
SKIPPED = 'plot: skipped (matplotlib is not installed: install with pip install -e ".[bench]")'


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(cells: dict[tuple[str, int, int], Cell], out: Path, title: str) -> str:
    """Latency (p50, p99) and throughput against N, one line per worker count, ours solid and
    naive dashed. Writes the PNG; returns the line to print."""
    try:
        plt = _pyplot()
        from matplotlib.ticker import FormatStrFormatter, NullFormatter
    except ImportError:
        return SKIPPED
    worker_counts = sorted({w for _, w, _ in cells})
    loads = sorted({n for _, _, n in cells})
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, w in enumerate(worker_counts):
        color = colors[i % len(colors)]
        for kind, style in ((OURS, "-"), (NAIVE, "--")):
            row = [cells[(kind, w, n)] for n in loads if (kind, w, n) in cells]
            xs = [n for n in loads if (kind, w, n) in cells]
            lat.plot(xs, [c.p50 for c in row], style, color=color, marker="o", label=f"{kind}, {w}w p50")
            lat.plot(xs, [c.p99 for c in row], style, color=color, marker="^", alpha=0.5, label=f"{kind}, {w}w p99")
            thr.plot(
                xs,
                [c.median(lambda s: s.throughput) for c in row],
                style,
                color=color,
                marker="o",
                label=f"{kind}, {w}w",
            )
    for ax in (lat, thr):
        ax.set_xscale("log")
        ax.set_xticks(loads, [str(n) for n in loads])
        ax.minorticks_off()
        ax.set_xlabel("concurrent parents (N)")
        ax.grid(True, which="both", alpha=0.3)
    lat.set_yscale("log")
    lat.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    lat.yaxis.set_minor_formatter(NullFormatter())
    lat.set_ylabel("submission -> answer (s)")
    lat.set_title("latency (p50 o, p99 ^)")
    thr.set_ylabel("parents / s")
    thr.set_title("throughput")
    thr.legend(fontsize=7, ncol=2)
    lat.legend(fontsize=6, ncol=2)
    return _save(plt, fig, out, title)


def plot_latency(by_latency: dict[float, dict[tuple[str, int, int], Cell]], out: Path, title: str) -> str:
    """Parents/s and p50 against the model's latency (one fixed delay per reply), one line per
    (workers, N), ours solid and naive dashed. Writes the PNG; returns the line to print."""
    try:
        plt = _pyplot()
    except ImportError:
        return SKIPPED
    latencies = sorted(by_latency)
    series = sorted({(w, n) for cells in by_latency.values() for _, w, n in cells})
    fig, (thr, lat) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (w, n) in enumerate(series):
        color = colors[i % len(colors)]
        for kind, style in ((OURS, "-"), (NAIVE, "--")):
            xs = [x for x in latencies if (kind, w, n) in by_latency[x]]
            if not xs:
                continue
            row = [by_latency[x][(kind, w, n)] for x in xs]
            label = f"{kind}, {w}w, N {n}"
            thr.plot(xs, [c.median(lambda s: s.throughput) for c in row], style, color=color, marker="o", label=label)
            lat.plot(xs, [c.p50 for c in row], style, color=color, marker="o", label=f"{label} p50")
    for ax in (thr, lat):
        ax.set_xticks(latencies, [f"{x:g}" for x in latencies])
        ax.set_xlabel("model latency per call (s)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    thr.set_ylabel("parents / s")
    thr.set_title("throughput")
    lat.set_ylabel("submission -> answer, p50 (s)")
    lat.set_title("latency")
    thr.legend(fontsize=7)
    lat.legend(fontsize=7)
    return _save(plt, fig, out, title)


def _save(plt: Any, fig: Any, out: Path, title: str) -> str:
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return f"plot: written to {out}"
