"""Console answer times: ``python bench/console.py [--sessions 100000] [--children 200] [--repeat 20]``.

Fills a throwaway database (bulk INSERT ... generate_series, then ANALYZE) with ``--sessions``
top-level sessions of mixed phases, agents and users, and one parent with ``--children`` children
(each a child session, its execution, a delegating round in the parent's history and its
delivered TOOL result), serves the console on loopback (uvicorn, as ``agent-recovery console``
does) and times, over real HTTP, ``--repeat`` requests of each page and API view a person opens:
the session with its children (page, live part, JSON), the list's first page, a filtered list,
a page deep in the list, health (page and JSON) and the approvals page. Prints the median and
the slowest of each, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def fill(sessions: int, children: int) -> int:
    """The history; returns the parent of the children."""
    from sqlalchemy import text

    from models import transaction

    with transaction() as s:
        s.execute(
            text(
                """
                INSERT INTO agent_session (user_id, session_type, agent_type, execution_mode, phase, epoch,
                                           started_at, updated_at)
                SELECT 'user' || (i % 500), 'NORMAL', (ARRAY['main', 'writer', 'planner'])[1 + i % 3], 'CLOUD',
                       (ARRAY['WAITING_USER', 'COMPLETED', 'FAILED', 'CANCELLED', 'RUNNING'])[1 + i % 5], 1,
                       now() - make_interval(secs => (:n - i) * 30), now() - make_interval(secs => (:n - i) * 30)
                FROM generate_series(1, :n) AS i
                """
            ),
            {"n": sessions},
        )
        parent = s.execute(
            text(
                "INSERT INTO agent_session (user_id, session_type, agent_type, execution_mode, phase, epoch,"
                " started_at, updated_at) VALUES ('user1', 'NORMAL', 'main', 'CLOUD', 'WAITING_USER', 3, now(), now())"
                " RETURNING id"
            )
        ).scalar_one()
        s.execute(
            text(
                """
                INSERT INTO agent_session (user_id, session_type, parent_session_id, agent_type, execution_mode,
                                           phase, epoch, started_at, updated_at)
                SELECT 'user1', 'SUBAGENT', :p, 'reviewer', 'CLOUD', 'COMPLETED', 0, now(), now()
                FROM generate_series(1, :c)
                """
            ),
            {"p": parent, "c": children},
        )
        s.execute(
            text(
                """
                INSERT INTO subagent_execution (parent_session_id, child_session_id, agent_type, task_description,
                    status, invocation_type, parent_tool_call_id, delivery_status, parent_result_delivered_at,
                    total_tool_calls, rounds, prompt_tokens, completion_tokens, total_tokens, started_at,
                    completed_at, epoch, resends, recoveries)
                SELECT :p, a.id, 'reviewer', 'task', 'COMPLETED', 'DELEGATE', 'call_' || a.id, 'DELIVERED', now(),
                       1, 2, 100, 20, 120, now(), now(), CASE WHEN a.id % 4 = 0 THEN 3 ELSE 1 END, 0,
                       CASE WHEN a.id % 4 = 0 THEN 1 ELSE 0 END
                FROM agent_session a WHERE a.parent_session_id = :p
                """
            ),
            {"p": parent},
        )
        calls = s.execute(
            text(
                "SELECT json_agg(json_build_object('id', 'call_' || id, 'type', 'function', 'function',"
                " json_build_object('name', 'delegate', 'arguments', '{\"task\": \"t\"}')) ORDER BY id)::text"
                " FROM agent_session WHERE parent_session_id = :p"
            ),
            {"p": parent},
        ).scalar_one()
        s.execute(
            text(
                "INSERT INTO message (session_id, role, content, deleted, created_at) VALUES (:p, 'USER', 'go', false,"
                " now()); INSERT INTO message (session_id, role, content, tool_calls, deleted, created_at)"
                " VALUES (:p, 'ASSISTANT', NULL, :calls, false, now())"
            ),
            {"p": parent, "calls": calls},
        )
        s.execute(
            text(
                """
                INSERT INTO message (session_id, role, content, tool_call_id, source_session_id, deleted, created_at)
                SELECT :p, 'TOOL', 'child answer', 'call_' || id, id, false, now()
                FROM agent_session WHERE parent_session_id = :p ORDER BY id
                """
            ),
            {"p": parent},
        )
        s.execute(
            text(
                """
                INSERT INTO message (session_id, role, content, deleted, created_at)
                SELECT id, r.role, 'x', false, now()
                FROM agent_session, (VALUES ('USER'), ('ASSISTANT'), ('ASSISTANT')) AS r(role)
                WHERE parent_session_id = :p
                """
            ),
            {"p": parent},
        )
    with transaction() as s:
        s.execute(text("ANALYZE"))
    return int(parent)


def time_get(http: object, url: str, repeat: int) -> tuple[float, float]:
    import requests

    assert isinstance(http, requests.Session)
    http.get(url, timeout=30).raise_for_status()  # warm (templates compiled, plans cached)
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        r = http.get(url, timeout=30)
        samples.append((time.perf_counter() - started) * 1000)
        r.raise_for_status()
    return statistics.median(samples), max(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--children", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    import os

    import requests

    from bench._common import bench_database, progress
    from console.auth import ConsoleConfig
    from tests.console_server import serve

    with bench_database("bench_console"):
        progress(f"filling {args.sessions} sessions and a parent with {args.children} children")
        started = time.monotonic()
        parent = fill(args.sessions, args.children)
        progress(f"filled in {time.monotonic() - started:.1f} s")
        with serve(ConsoleConfig(token="", read_only=False, show_content=False)) as base:
            http = requests.Session()
            deep = parent - args.sessions // 2
            views = [
                (f"session with {args.children} children: page", f"/sessions/{parent}"),
                (f"session with {args.children} children: live part", f"/sessions/{parent}/live"),
                (f"session with {args.children} children: JSON", f"/api/sessions/{parent}"),
                (f"list of {args.sessions} sessions: first page (page)", "/"),
                (f"list of {args.sessions} sessions: first page (JSON)", "/api/sessions"),
                (f"list of {args.sessions} sessions: failed=true (JSON)", "/api/sessions?failed=true"),
                (
                    f"list of {args.sessions} sessions: agent=writer&user=user7 (JSON)",
                    "/api/sessions?agent=writer&user=user7",
                ),
                (f"list of {args.sessions} sessions: recovered=true (JSON)", "/api/sessions?recovered=true"),
                (f"list of {args.sessions} sessions: a page in the middle (JSON)", f"/api/sessions?before={deep}"),
                ("health: verdict, workers, queues (page)", "/health"),
                ("health: verdict, workers, queues (JSON)", "/api/health"),
                ("approvals (page)", "/approvals"),
            ]
            load = os.getloadavg()[0]
            print(f"console answer times over loopback HTTP, {args.repeat} requests each (load average {load:.2f})")
            for name, path in views:
                median, slowest = time_get(http, base + path, args.repeat)
                print(f"  {name:<66} median {median:7.1f} ms   slowest {slowest:7.1f} ms")
            print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
