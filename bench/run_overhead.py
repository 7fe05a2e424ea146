"""What every run pays besides its statements and its model call: ``python bench/run_overhead.py
[--runs N] [--rounds R]``.

Each child run and each parent run holds a heartbeat (``harness.fence.Heartbeat``) and asks for
two ``session_status`` events (``harness.events.publish_status``). In one process, on the bench's
Redis, alternating in rounds, each against its baseline measured in the same run:

- heartbeat: enter and exit of ``Heartbeat`` around an empty body, against the thread a run used
  to start and join (a thread waiting on an Event, as ``Heartbeat`` did before);
- status event: what ``publish_status`` costs the run that asks for it, against a synchronous
  ``PUBLISH`` (what it did before). The events are asked for one at a time with a pause of
  ``--pause-ms`` between them (as a run asks: one at its start, one at its end), so the
  publisher's thread sends each alone; its CPU is counted apart (the process's CPU less the
  caller's own), since it is still spent, on another thread.

And what a model call's transport costs: ``ModelClient.complete`` against the scripted model in
this process (one short answer), kept alive (HTTP/1.1, as providers answer and as the stand-in
answers now) against a connection per call (the stand-in's HTTP/1.0 before, ``keep_alive=False``).
The stand-in's threads run in this process, so the CPU beside the caller's is the server's:
``--model-calls`` calls per round (0 leaves this pair out).

Prints wall and CPU per call (medians of the rounds, with their spread) and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)


def _thread_per_run(n: int) -> None:
    """The baseline heartbeat: a thread started and joined per run."""
    for _ in range(n):
        stop = threading.Event()
        t = threading.Thread(target=stop.wait, args=(30,), daemon=True)
        t.start()
        stop.set()
        t.join(5)


def _kept_renewer(n: int) -> None:
    from harness.fence import Fence, Heartbeat

    class _Fence(Fence):
        def renew(self) -> bool:
            return True

    fence = _Fence(session_id=1, epoch=1, lease_seconds=30)
    for _ in range(n):
        with Heartbeat(fence):
            pass


def _model_calls(keep_alive: bool) -> Callable[[int], None]:
    """n calls of ``ModelClient.complete`` on one client against an in-process stand-in."""
    from doubles.scripted_model import ScriptedModelServer
    from harness.model import ModelClient

    server = ScriptedModelServer([{"reply": {"content": "ok"}}], keep_alive=keep_alive)
    client = ModelClient(server.start(), "", "bench", 5.0, 30.0)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]

    def run(n: int) -> None:
        for _ in range(n):
            client.complete(messages)

    return run


def _timed(fn: Callable[[int], None], n: int) -> tuple[float, float, float]:
    """(wall, caller thread's CPU, whole process CPU) per call, in microseconds."""
    w, c, p = time.perf_counter(), time.thread_time(), time.process_time()
    fn(n)
    w, c, p = time.perf_counter() - w, time.thread_time() - c, time.process_time() - p
    return w / n * 1e6, c / n * 1e6, p / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=300, help="calls per round (default 300)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (default 7)")
    parser.add_argument("--pause-ms", type=float, default=2.0, help="pause between two events (default 2)")
    parser.add_argument("--model-calls", type=int, default=200, help="model calls per round (default 200; 0: none)")
    args = parser.parse_args()

    from bench._common import REDIS_BASE, REDIS_DBS
    from bench._figures import median, spread, system_load

    url = f"{REDIS_BASE}/{REDIS_DBS[2]}"
    os.environ["REDIS_URL"] = url
    import redis

    from harness.events import CHANNEL, flush_status_events, publish_status
    from settings import get_settings

    get_settings.cache_clear()
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    pause = args.pause_ms / 1000
    spent: list[tuple[float, float]] = []

    def paced(call: Callable[[int], None]) -> Callable[[int], None]:
        """n calls, one every ``pause``; only the calls are timed (their wall and the caller's CPU
        summed in ``spent``), the pauses are not."""

        def run(n: int) -> None:
            wall = cpu = 0.0
            for i in range(n):
                w, c = time.perf_counter(), time.thread_time()
                call(i)
                wall += time.perf_counter() - w
                cpu += time.thread_time() - c
                time.sleep(pause)
            flush_status_events(10)
            spent.append((wall / n * 1e6, cpu / n * 1e6))

        return run

    def sync_publish(i: int) -> None:
        client.publish(CHANNEL, json.dumps({"type": "session_status", "session_id": i, "phase": "RUNNING"}))

    def threaded_publish(i: int) -> None:
        publish_status(i, "RUNNING")

    print(f"run overhead: {args.rounds} rounds x {args.runs} calls, {system_load()}", flush=True)
    cases = {
        "heartbeat, a thread per run (baseline)": _thread_per_run,
        "heartbeat, a kept renewer (ours)": _kept_renewer,
        "status event, synchronous PUBLISH (baseline)": paced(sync_publish),
        "status event, the publisher thread (ours)": paced(threaded_publish),
    }
    if args.model_calls > 0:
        cases["model call, a connection per call (baseline)"] = _model_calls(keep_alive=False)
        cases["model call, kept alive (ours)"] = _model_calls(keep_alive=True)
    calls = {name: args.model_calls if name.startswith("model call") else args.runs for name in cases}
    for fn in cases.values():  # warm: imports, the first thread, the connection
        fn(20)
    #: (wall, caller's CPU, other threads' CPU) per call, microseconds
    figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name in cases}
    for r in range(args.rounds):
        for name, fn in cases.items():
            spent.clear()
            w, c, p = _timed(fn, calls[name])
            other = max(0.0, p - c)  # the process's CPU less the calling thread's
            if spent:  # a paced case: only its calls' own time
                w, c = spent[0]
            figures[name].append((w, c, other))
        print(f"  .. round {r + 1}/{args.rounds}", flush=True)
    for name, rows in figures.items():
        walls = [w for w, _, _ in rows]
        print(
            f"{name}: wall {median(walls):.1f} us per call ({spread(walls)}), the caller's CPU "
            f"{median([c for _, c, _ in rows]):.1f} us, other threads' CPU {median([o for _, _, o in rows]):.1f} us"
        )
    names = list(cases)
    hb = median([w for w, _, _ in figures[names[1]]]) / median([w for w, _, _ in figures[names[0]]])
    ev = median([w for w, _, _ in figures[names[3]]]) / median([w for w, _, _ in figures[names[2]]])
    print(f"heartbeat ratio ours/baseline, the run's wall per run: {hb:.3f}")
    print(f"status event ratio ours/baseline, the run's wall per event: {ev:.3f}")
    if args.model_calls > 0:
        base, ours = figures[names[4]], figures[names[5]]
        wall = median([w for w, _, _ in ours]) / median([w for w, _, _ in base])
        cpu = median([c + o for _, c, o in ours]) / median([c + o for _, c, o in base])
        print(f"model call ratio ours/baseline: wall {wall:.3f}, CPU of client and stand-in {cpu:.3f}")
    print(f"done; {system_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
