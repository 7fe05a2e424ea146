"""Where a worker's boot goes: ``python bench/boot.py [--boots 5] [--imports]``.

Starts ``celery -A tasks worker -P prefork -c 2 -n boot@%h`` (the flags of ``devstack.Worker``
and ``bench/peer_dbos.py``'s restart, embedded beat included) ``--boots`` times on a
throwaway database and the bench's Redis, and prints from each spawn:

- the time to ``worker_ready`` of the plain ``celery`` command, and of the same command
  through ``bench/_boot_marks.py`` (alternating, so the marks' own cost shows);
- with the marks, each step of the boot (Python's start, Celery's command line, the app, the
  task modules and the worker's set-up, ``worker_init``'s receivers, the pool, the beat and
  the consumer) and the main process's CPU at ready: medians and spread.

``--imports`` adds one boot under ``python -X importtime`` and sums the import time by
top-level package (self times, so nothing is counted twice), each marked ours, a dependency
of ours (the closure of ``agent-recovery``'s requirements, extras left out), the standard
library, or neither: installed in this environment and imported by something that finds it
(kombu imports PyYAML when it is there; Celery's command line imports Pygments and builds a
lexer, counted as Celery's own time, when pytest brought Pygments in). ``-X importtime`` slows
every import; its figures are shares, the first table's are the times.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

#: The steps ``bench/_boot_marks.py`` prints, in order, and what each interval ending there holds.
STEPS = {
    "interpreter": "Python's start (site, the standard library)",
    "cli": "Celery's command line (celery.bin.celery and its subcommands)",
    "app": "the app: tasks/ package, settings, tools, models (SQLAlchemy)",
    "worker_init": "the task modules, the worker's set-up, the broker's transport (redis-py)",
    "after_setup": "worker_init's receivers (the boot generation, work done once before the fork), the bootsteps",
    "ready": "the banner, the pool's fork, the embedded beat, the consumer's connection",
}
MARK = re.compile(r"boot_mark step=(\w+) t=([\d.]+) cpu=([\d.]+) pid=(\d+)")
#: The worker's prefork pool size (``-c`` in worker_argv).
POOL_PROCESSES = 2
IMPORT_TIME = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


@dataclass
class Boot:
    ready_s: float  #: spawn -> the ready line seen in the log (the same polling for both kinds)
    marks: dict[str, float] = field(default_factory=dict)  #: step -> seconds since spawn
    cpu_s: float = 0.0  #: the main process's CPU at ready
    pool_s: list[float] = field(default_factory=list)  #: each pool process initialized


def worker_argv(log_dir: Path, n: int) -> list[str]:
    return [
        "-A",
        "tasks",
        "worker",
        "-P",
        "prefork",
        "-c",
        str(POOL_PROCESSES),
        "-n",
        f"boot{n}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "INFO",
        "-B",
        "-s",
        str(log_dir / f"beat-{n}"),
    ]


def _await_pool_marks(log_path: Path, processes: int, timeout: float = 5.0) -> None:
    """After the ready mark, wait (at most ``timeout``) for each pool process's mark: a forked
    child writes its own after it initializes, which on a busy machine can come after the main
    process's ready (the ready time is taken before; this only keeps the kill from cutting the
    children's marks off)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log_path.read_text(errors="replace").count("boot_mark step=pool_process") >= processes:
            return
        time.sleep(0.01)


def one_boot(env: dict[str, str], log_dir: Path, n: int, marked: bool) -> Boot:
    """Spawn one worker, wait for its ready line, read its marks, stop it (process group)."""
    from devstack.processes import CELERY, ROOT

    head = [sys.executable, "-m", "bench._boot_marks"] if marked else [CELERY]
    log_path = log_dir / f"worker-{n}-{'marked' if marked else 'plain'}.log"
    ready_line = "boot_mark step=ready" if marked else "event=worker_ready"
    with open(log_path, "wb") as out:
        spawned = time.monotonic()
        proc = subprocess.Popen(
            [*head, *worker_argv(log_dir, n)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = spawned + 60
            while True:
                text = log_path.read_text(errors="replace")
                if ready_line in text:
                    ready_s = time.monotonic() - spawned
                    if marked:
                        _await_pool_marks(log_path, POOL_PROCESSES)
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {n} not ready (exit {proc.poll()}):\n{text[-3000:]}")
                time.sleep(0.005)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    boot = Boot(ready_s)
    for step, t, cpu, pid in MARK.findall(log_path.read_text(errors="replace")):
        at = float(t) - spawned
        if step == "pool_process":
            boot.pool_s.append(at)
        else:
            boot.marks.setdefault(step, at)
            if step == "ready" and int(pid) == proc.pid:
                boot.cpu_s = float(cpu)
    return boot


def dependency_modules() -> set[str]:
    """Top-level module names of the distributions ``agent-recovery`` requires (its base
    requirements and theirs, no extras)."""
    from importlib import metadata

    wanted: set[str] = set()
    todo = ["agent-recovery"]
    while todo:
        name = _canonical(todo.pop())
        if name in wanted:
            continue
        wanted.add(name)
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for requirement in requirements:
            if "extra ==" in requirement:
                continue
            marker = requirement.partition(";")[2].strip()
            if marker and not _marker_holds(marker):
                continue
            todo.append(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0])
    modules = set()
    for module, dists in metadata.packages_distributions().items():
        if any(_canonical(d) in wanted for d in dists):
            modules.add(module)
    return modules


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _marker_holds(marker: str) -> bool:
    try:
        from packaging.markers import Marker

        return bool(Marker(marker).evaluate({"extra": ""}))
    except Exception:  # no packaging, or a marker it cannot read: count the requirement
        return True


def ours() -> set[str]:
    from devstack.processes import ROOT

    names = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return names | {p.stem for p in ROOT.glob("*.py")}


def import_shares(env: dict[str, str], log_dir: Path) -> list[tuple[str, float, str]]:
    """One boot under ``-X importtime``: (top-level package, ms of self time, whose)."""
    from devstack.processes import ROOT

    log_path = log_dir / "importtime.log"
    with open(log_path, "wb") as out:
        subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "bench._boot_marks", *worker_argv(log_dir, 999)],
            cwd=ROOT,
            env={**env, "BOOT_MARKS_EXIT": "1"},
            stdout=subprocess.DEVNULL,
            stderr=out,
            timeout=120,
            check=False,
        )
    totals: dict[str, float] = {}
    for self_us, _cumulative, _indent, module in IMPORT_TIME.findall(log_path.read_text(errors="replace")):
        top = module.split(".")[0]
        totals[top] = totals.get(top, 0.0) + int(self_us) / 1000
    if not totals:
        raise RuntimeError(f"no import times in {log_path}")
    mine, deps = ours(), dependency_modules()

    def whose(top: str) -> str:
        if top in mine:
            return "ours"
        if top in deps:
            return "dependency"
        return "stdlib" if top in sys.stdlib_module_names else "neither"

    return sorted(((top, ms, whose(top)) for top, ms in totals.items()), key=lambda row: -row[1])


def _seconds(values: list[float]) -> str:
    """``min .. max s`` of the boots, beside their median."""
    return f"{min(values):.3f} .. {max(values):.3f} s"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boots", type=int, default=5, help="boots of each kind, alternating (default 5)")
    parser.add_argument("--imports", action="store_true", help="also one boot under -X importtime, by package")
    parser.add_argument("--top", type=int, default=15, help="packages listed with --imports (default 15)")
    args = parser.parse_args(argv)
    if args.boots < 1:
        parser.error("--boots must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = parse_args(argv)
    from bench._common import bench_database, bench_env, flush_redis, progress
    from bench._cpu import settle
    from bench._figures import median, system_load

    with bench_database("bench_boot") as url, tempfile.TemporaryDirectory(prefix="bench-boot-") as tmp:
        log_dir = Path(tmp)
        env = bench_env(url, "http://127.0.0.1:9/v1")
        print(
            f"worker boot: celery -A tasks worker -c 2 -B, {args.boots} boots plain and {args.boots} with the marks, "
            f"alternating; {system_load()}",
            flush=True,
        )
        plain: list[Boot] = []
        marked: list[Boot] = []
        for n in range(args.boots):
            for is_marked, into in ((False, plain), (True, marked)):
                flush_redis()
                progress(settle(cap=3).note())
                boot = one_boot(env, log_dir, 2 * n + int(is_marked), is_marked)
                into.append(boot)
                progress(
                    f"boot {n + 1} {'marked' if is_marked else 'plain'}: ready after {boot.ready_s:.3f} s"
                    + (f", main process CPU {boot.cpu_s:.3f} s" if is_marked else "")
                )
        flush_redis()
        shares = import_shares(env, log_dir) if args.imports else []

    ready_plain, ready_marked = [b.ready_s for b in plain], [b.ready_s for b in marked]
    print(f"spawn -> ready, plain celery: {median(ready_plain):.3f} s ({_seconds(ready_plain)})")
    print(
        f"spawn -> ready, through the marks: {median(ready_marked):.3f} s ({_seconds(ready_marked)}); "
        f"marks / plain {median(ready_marked) / median(ready_plain):.2f}"
    )
    print("the boot's steps (medians of the marked boots; seconds since spawn, then the step's own time):")
    before = [0.0] * len(marked)
    for step, what in STEPS.items():
        at = [b.marks.get(step, float("nan")) for b in marked]
        own = [a - p for a, p in zip(at, before, strict=True)]
        print(f"  {median(at):6.3f} s  +{median(own):.3f} s ({_seconds(own)})  {step}: {what}")
        before = at
    pools = [min(b.pool_s) for b in marked if b.pool_s]
    if pools:
        print(f"  first pool process initialized {median(pools):.3f} s after spawn ({_seconds(pools)})")
    cpu = [b.cpu_s for b in marked]
    print(f"main process CPU at ready: {median(cpu):.3f} s ({_seconds(cpu)}); {system_load()}")
    if shares:
        total = sum(ms for _, ms, _ in shares)
        by_whose: dict[str, float] = {}
        for _, ms, whose in shares:
            by_whose[whose] = by_whose.get(whose, 0.0) + ms
        print(f"imports under -X importtime (self time, {total:.0f} ms in all; -X importtime inflates them):")
        for whose in ("ours", "dependency", "stdlib", "neither"):
            print(f"  {by_whose.get(whose, 0.0):7.1f} ms  {100 * by_whose.get(whose, 0.0) / total:4.1f} %  {whose}")
        print(f"  top {args.top} packages:")
        for top, ms, whose in shares[: args.top]:
            print(f"  {ms:7.1f} ms  {top} ({whose})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
