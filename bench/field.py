"""Field recovery against the SuperAgent stand-in: ``python bench/field.py [--runs R]``.

Everything runs in this process, in-process stand-in (a real HTTP server on loopback) and
the real pipeline (``FieldRecoveryOrchestrator.process``) on a throwaway PostgreSQL database:

1. replay: one EML is recovered once (the provider is called), then processed again
   ``--replays`` times per run: every call must be a replay (no provider call). Latency of a
   whole ``process()`` call, p50/p99.
2. overhead: ``--calls`` fresh recoveries per run (a new attempt each, so a new idempotency key
   and a provider call), beside the stand-in's own time: the same three HTTP exchanges (create
   session, message stream read to ``end``, run status) made by a minimal ``requests`` client
   with nothing else, and our Open API client alone (``OpenApiClient.recover``). Overhead per
   call = the pipeline's p50 minus the minimal client's p50.
3. deadline: for each stall of the stand-in (``--stalls``: ``slow`` = silence before the final
   answer, ``slow_drip`` = the same with keep-alive comments that defeat read timeouts,
   ``slow_headers`` = the stream's status line and headers one byte at a time), ``--calls``
   recoveries with ``max_wait = --deadline-seconds``; how far past the deadline each call
   returns (the whole ``process()`` call minus max_wait, so the parsing and the claim before
   the deadline starts count against us too), p50/p99. Every call must fail closed with
   ``deadline_exceeded``.

4. SSE: one event as large as the client's default byte budget (8 x max_response_chars +
   64 KiB), made of short ``data:`` lines (the worst case of a quadratic framer),
   framed and parsed by ``fieldrecovery.sse.EventParser`` from 8 KiB reads; median of 5.
   ``--sse-only`` prints this figure alone (no database, no stand-in).

Figures 1 and 2 are medians over ``--runs`` runs of each run's p50, printed with their spread:
p10 and p90 (and p99) over every call, min .. max of the runs' p50s, and the load average.
``--replay-only`` measures figure 1 alone (no fresh or stalled calls, no SSE figure).
"""

from __future__ import annotations

import argparse
import importlib
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

if __package__ in (None, ""):  # run as a script: the project root, not bench/, comes first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

API_KEY = "df_open_bench_field"
STALLS = ("slow", "slow_drip", "slow_headers")


def stand_in_module() -> ModuleType:
    """The SuperAgent stand-in, wherever it lives (``doubles.superagent``, formerly
    ``recovery.field.stub``)."""
    for name in ("doubles.superagent", "recovery.field.stub"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no SuperAgent stand-in: neither doubles.superagent nor recovery.field.stub")


def sample_eml() -> bytes:
    from bench._common import ROOT

    return (ROOT / "tests" / "data" / "field_booking_ambiguous.eml").read_bytes()


def field_settings(base_url: str, **changes: Any) -> Any:
    from settings import FieldRecoverySettings

    return FieldRecoverySettings.model_validate(
        {"enabled": True, "open_api": {"base_url": base_url, "api_key": API_KEY}, "max_wait": 10, **changes}
    )


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    out = call()
    return time.perf_counter() - started, out


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:7.2f} ms"


# --- the stand-in's own time: a minimal client ---------------------------------------------


def raw_exchange(base_url: str, message: str, key: str, subject: str) -> None:
    """Create a session, read the message stream to its end, read the run status: the three
    HTTP exchanges of one recovery, with nothing else (no deadline, no parsing, no checks).

    The connections are used as our client uses them (session and stream on one connection,
    the run status on a fresh one): on loopback a request on a kept-alive connection waits
    ~40 ms for the stand-in's header and body writes (Nagle against delayed ACK), a cost of
    the connection pattern that would otherwise count against or for us."""
    import json

    import requests

    def headers() -> tuple[dict[str, str], dict[str, str]]:
        token = secrets.token_urlsafe(32)
        return {"Authorization": f"Bearer {API_KEY}", "X-CSRF-Token": token}, {"csrf_token": token}

    with requests.Session() as http:
        h, c = headers()
        session = http.post(
            f"{base_url}/open/v1/sessions", json={"external_subject_id": subject}, headers=h, cookies=c, timeout=10
        ).json()["session_id"]
        h, c = headers()
        run_id = None
        with http.post(
            f"{base_url}/open/v1/sessions/{session}/messages/stream",
            json={"content": message, "idempotency_key": key},
            headers={**h, "Accept": "text/event-stream"},
            cookies=c,
            stream=True,
            timeout=10,
        ) as stream:
            for line in stream.iter_lines():
                if run_id is None and line.startswith(b"data: ") and b"run_id" in line:
                    run_id = json.loads(line[6:])["run_id"]
    h, c = headers()
    requests.get(f"{base_url}/open/v1/runs/{run_id}", headers=h, cookies=c, timeout=10).json()


# --- the runs --------------------------------------------------------------------------------


@dataclass
class Run:
    replay: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    client: list[float] = field(default_factory=list)
    pipeline: list[float] = field(default_factory=list)

    def p50(self, name: str) -> float:
        return float(statistics.median(getattr(self, name)))


class Bench:
    def __init__(self, url: str, stand_in: Any, module: ModuleType) -> None:
        from fieldrecovery.eml import parse_eml

        self.url, self.stand_in, self.module = url, stand_in, module
        self.eml = sample_eml()
        self.facts = parse_eml(self.eml)
        self.attempt = 1

    def orchestrator(self, **changes: Any) -> Any:
        from fieldrecovery.orchestrator import FieldRecoveryOrchestrator

        return FieldRecoveryOrchestrator(field_settings(self.stand_in.base_url, **changes), url=self.url)

    def next_attempt(self) -> int:
        self.attempt += 1
        return self.attempt

    def replay_calls(self, n: int) -> list[float]:
        orchestrator = self.orchestrator()
        out = []
        for _ in range(n):
            seconds, run = _timed(lambda: orchestrator.process(self.eml, attempt=1))
            if not run.replayed or run.provider_calls or run.status.value != "SUCCEEDED":
                raise RuntimeError(f"not a replay: {run.status} replayed={run.replayed} calls={run.provider_calls}")
            out.append(seconds)
        return out

    def fresh_calls(self, n: int, run: Run) -> None:
        """Per call, alternating: the minimal client, our client alone, the whole pipeline."""
        from fieldrecovery.client import CallProgress, client_for
        from fieldrecovery.deadline import Deadline
        from fieldrecovery.request_builder import build_request, render_message
        from fieldrecovery.schemas import sha256_hex

        settings = field_settings(self.stand_in.base_url)
        orchestrator = self.orchestrator()
        subject = sha256_hex(self.facts.source.message_id)
        for _ in range(n):
            request = build_request(self.facts, profile_version=settings.profile_version, attempt=self.next_attempt())
            assert request is not None
            message = render_message(request)
            key = request.idempotency_key
            seconds, _ = _timed(lambda: raw_exchange(self.stand_in.base_url, message, key, subject))  # noqa: B023
            run.raw.append(seconds)
            client = client_for(settings)
            seconds, _ = _timed(
                lambda: client.recover(  # noqa: B023
                    message,  # noqa: B023
                    idempotency_key=key,  # noqa: B023
                    subject_id=subject,
                    deadline=Deadline(settings.max_wait),
                    progress=CallProgress(),
                )
            )
            run.client.append(seconds)
            attempt = self.next_attempt()
            seconds, out = _timed(lambda: orchestrator.process(self.eml, attempt=attempt))  # noqa: B023
            if out.status.value != "SUCCEEDED" or out.provider_calls != 1:
                raise RuntimeError(f"a fresh recovery ended {out.status} ({out.error_code})")
            run.pipeline.append(seconds)

    def stalled_calls(self, stall: str, n: int, deadline_seconds: float) -> tuple[list[float], list[str]]:
        """``n`` recoveries against a stalling stand-in; (seconds past the deadline, problems)."""
        behaviour = self.module.Behaviour
        changes: dict[str, Any] = {"stall_seconds": 60.0, "drip": False}
        if stall == "slow_headers":
            changes = {"behaviour": behaviour("slow_headers"), "header_drip_seconds": 0.5}
        else:
            changes["behaviour"] = behaviour.SLOW
            changes["drip"] = stall == "slow_drip"
        self.stand_in.configure(**changes)
        orchestrator = self.orchestrator(max_wait=deadline_seconds)
        late, problems = [], []
        try:
            for _ in range(n):
                attempt = self.next_attempt()
                seconds, out = _timed(lambda: orchestrator.process(self.eml, attempt=attempt))  # noqa: B023
                late.append(seconds - deadline_seconds)
                if out.error_code != "deadline_exceeded":
                    problems.append(f"{stall}: a call ended {out.status} ({out.error_code})")
        finally:
            self.stand_in.configure(behaviour=behaviour.NORMAL, drip=False)
        return late, problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/field.py", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of the replay and overhead figures (default 3)")
    parser.add_argument("--replays", type=int, default=200, help="replays of a finished key per run (default 200)")
    parser.add_argument("--calls", type=int, default=50, help="fresh calls per run, stalled calls per stall (50)")
    parser.add_argument("--deadline-seconds", type=float, default=0.5, help="max_wait of the stalled calls (0.5)")
    parser.add_argument("--stalls", default=",".join(STALLS), help=f"comma-separated, of {', '.join(STALLS)}")
    parser.add_argument("--sse-only", action="store_true", help="print the SSE budget-sized event figure alone")
    parser.add_argument("--replay-only", action="store_true", help="measure the replay figure alone")
    args = parser.parse_args(argv)
    args.stalls = [s.strip() for s in args.stalls.split(",") if s.strip()]
    if set(args.stalls) - set(STALLS):
        parser.error(f"--stalls takes a comma-separated list of {', '.join(STALLS)}")
    if min(args.runs, args.replays, args.calls) < 1 or args.deadline_seconds <= 0:
        parser.error("--runs, --replays and --calls must be >= 1, --deadline-seconds > 0")
    return args


def sse_budget_event(repeats: int = 5) -> tuple[int, int, float]:
    """(bytes, lines, median seconds) to frame and parse one budget-sized event of short lines."""
    from fieldrecovery.client import OpenApiClient
    from fieldrecovery.deadline import Deadline
    from fieldrecovery.sse import READ_CHUNK_BYTES, EventParser
    from settings import FieldRecoverySettings

    settings = FieldRecoverySettings()
    budget = OpenApiClient(settings.open_api, max_response_chars=settings.max_response_chars)._byte_budget
    line = b"data: x\n"
    lines = (budget - 64) // len(line)
    body = b"event: message.delta\n" + line * lines + b"\n"
    chunks = [body[i : i + READ_CHUNK_BYTES] for i in range(0, len(body), READ_CHUNK_BYTES)]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        events = list(EventParser(Deadline(60)).events(chunks))
        times.append(time.perf_counter() - started)
        if len(events) != 1:
            raise RuntimeError(f"the budget-sized event was framed as {len(events)} events")
    return len(body), lines, statistics.median(times)


def _print_sse_figure() -> None:
    size, lines, seconds = sse_budget_event()
    print(
        f"SSE: one budget-sized event ({size} bytes, {lines} short data lines) framed and parsed in {_ms(seconds)} "
        f"({seconds / size * 1e9:.0f} ns/byte; median of 5)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sse_only:
        _print_sse_figure()
        return 0
    from bench._common import bench_database, percentile, progress
    from bench._figures import median, spread, system_load

    module = stand_in_module()
    stalls = [s for s in args.stalls if s != "slow_headers" or "slow_headers" in {b.value for b in module.Behaviour}]
    print(
        f"field: the stand-in {module.__name__}.SuperAgentStub on loopback, the pipeline in this process; "
        + (
            f"{args.runs} runs x {args.replays} replays (--replay-only); "
            if args.replay_only
            else f"{args.runs} runs x ({args.replays} replays + {args.calls} fresh calls); {args.calls} stalled calls "
            f"per stall ({', '.join(stalls)}), max_wait {args.deadline_seconds:g} s; "
        )
        + system_load(),
        flush=True,
    )
    runs: list[Run] = []
    late: dict[str, list[float]] = {}
    problems: list[str] = []
    with bench_database("bench_field") as url, module.SuperAgentStub(api_key=API_KEY) as stand_in:
        bench = Bench(url, stand_in, module)
        first = bench.orchestrator().process(bench.eml, attempt=1)
        if first.status.value != "SUCCEEDED" or first.provider_calls != 1:
            raise RuntimeError(f"the first recovery ended {first.status} ({first.error_code})")
        bench.fresh_calls(3, Run())  # warm-up: connections, imports, plans
        bench.replay_calls(20)
        for r in range(1, args.runs + 1):
            run = Run(replay=bench.replay_calls(args.replays))
            if args.replay_only:
                runs.append(run)
                progress(f"run {r}: replay p50 {_ms(run.p50('replay'))}; {system_load()}")
                continue
            bench.fresh_calls(args.calls, run)
            runs.append(run)
            progress(
                f"run {r}: replay p50 {_ms(run.p50('replay'))}; fresh call p50: minimal client {_ms(run.p50('raw'))}, "
                f"our client {_ms(run.p50('client'))}, pipeline {_ms(run.p50('pipeline'))}; {system_load()}"
            )
        for stall in [] if args.replay_only else stalls:
            late[stall], found = bench.stalled_calls(stall, args.calls, args.deadline_seconds)
            problems += found
            progress(f"{stall}: p50 {_ms(statistics.median(late[stall]))} past the deadline; {system_load()}")

    def p50(name: str) -> float:
        return median([r.p50(name) for r in runs])

    def p(name: str, q: float) -> float:
        return percentile([x for r in runs for x in getattr(r, name)], q)

    def spread_of(name: str) -> str:
        run_p50s = [r.p50(name) for r in runs]
        return (
            f"p10 {_ms(p(name, 10))}  p90 {_ms(p(name, 90))}  p99 {_ms(p(name, 99))}; "
            f"runs' p50 {spread(run_p50s, 1000, ' ms')}"
        )

    print(
        f"replay of a finished key: p50 {_ms(p50('replay'))}  {spread_of('replay')}  (whole process() call, "
        f"no provider call; median of {args.runs} runs' p50, percentiles over {args.runs * args.replays} calls; "
        f"{system_load()})"
    )
    if args.replay_only:
        return 0
    print(f"fresh call, minimal client (the stand-in's own time): p50 {_ms(p50('raw'))}  {spread_of('raw')}")
    print(f"fresh call, our Open API client alone:                p50 {_ms(p50('client'))}  {spread_of('client')}")
    print(
        f"fresh call, the whole pipeline:                       p50 {_ms(p50('pipeline'))}  {spread_of('pipeline')}  "
        f"({system_load()})"
    )
    overhead = median([r.p50("pipeline") - r.p50("raw") for r in runs])
    client_overhead = median([r.p50("client") - r.p50("raw") for r in runs])
    print(
        f"our overhead per call beyond the stand-in's own time: {_ms(overhead)} (pipeline p50 - minimal client p50; "
        f"of which the client {_ms(client_overhead)}; median of {args.runs} runs; {system_load()})"
    )
    for stall in stalls:
        print(
            f"return after the deadline, {stall}: p50 {_ms(statistics.median(late[stall]))}  "
            f"p99 {_ms(percentile(late[stall], 99))}  (over {len(late[stall])} calls, max_wait "
            f"{args.deadline_seconds:g} s; {system_load()})"
        )
    _print_sse_figure()
    if problems:
        print(f"fail-closed checks: VIOLATED ({len(problems)})")
        for problem in problems[:20]:
            print(f"  {problem}")
        return 1
    print("fail-closed checks: ok (every replay without a provider call, every stalled call deadline_exceeded)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
