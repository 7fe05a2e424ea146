"""Real Celery worker subprocesses for the demo, the crash tests, the soak and the benchmarks
(no Docker; workers killed by process group with SIGKILL). A worker runs as the Procfile runs
it unless its caller says otherwise: the ``celery`` queue on threads, ``recovery`` on prefork."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Redis server of the stack (no database number); the test suite sets it from TEST_REDIS_URL, so
#: one variable points every test, stack helper and worker at another server.
REDIS_BASE = os.environ.get("STACK_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")
#: Redis databases of the stack (broker, result backend, events); STACK_REDIS_DBS="b,r,e" lets
#: two stacks share one Redis server without consuming each other's messages.
BROKER_DB, BACKEND_DB, EVENTS_DB = (int(x) for x in os.environ.get("STACK_REDIS_DBS", "14,15,13").split(","))
#: RabbitMQ of the stack when the broker is amqp (Redis stays the result backend and the events).
AMQP_URL = os.environ.get("STACK_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: Queues a stack's workers consume (Celery's default queue and the recovery queue), purged by flush_broker.
AMQP_QUEUES = tuple(os.environ.get("STACK_AMQP_QUEUES", "celery,recovery").split(","))


def stack_broker() -> str:
    """The stack's broker: STACK_BROKER=amqp for RabbitMQ, else Redis. Read at each call, so a
    test can choose it with monkeypatch.setenv."""
    broker = os.environ.get("STACK_BROKER", "redis").strip().lower() or "redis"
    if broker not in ("redis", "amqp"):
        raise ValueError(f"STACK_BROKER must be redis or amqp, not {broker!r}")
    return broker


def broker_url(broker: str | None = None, redis_base: str | None = None) -> str:
    return AMQP_URL if (broker or stack_broker()) == "amqp" else f"{redis_base or REDIS_BASE}/{BROKER_DB}"


def service_env(
    pg_url: str,
    model_url: str,
    redis_base: str | None = None,
    broker: str | None = None,
    **extra: str,
) -> dict[str, str]:
    redis_base = redis_base or REDIS_BASE
    env = dict(os.environ)
    env.update(
        DATABASE_URL=pg_url,
        CELERY_BROKER_URL=broker_url(broker, redis_base),
        CELERY_RESULT_BACKEND=f"{redis_base}/{BACKEND_DB}",
        REDIS_URL=f"{redis_base}/{EVENTS_DB}",
        MODEL_BASE_URL=model_url,
        LEASE_SECONDS="3",
        SCAN_INTERVAL_SECONDS="2",
        PYTHONPATH=str(ROOT),
        CRASH_POINT="",
    )
    env.update(extra)
    return env


#: What apply_env sets in this process (a test's Stack puts these back when it closes).
APPLIED_ENV_KEYS = (
    "DATABASE_URL",
    "CELERY_BROKER_URL",
    "CELERY_RESULT_BACKEND",
    "REDIS_URL",
    "MODEL_BASE_URL",
    "LEASE_SECONDS",
    "SCAN_INTERVAL_SECONDS",
    "SUBAGENT_TIMEOUT_SECONDS",
    "SUBAGENT_CANCEL_GRACE_SECONDS",
)


def apply_env(env: dict[str, str]) -> None:
    """Make this (test) process use the same services as the workers."""
    for key in APPLIED_ENV_KEYS:
        if key in env:
            os.environ[key] = env[key]
    from settings import get_settings

    get_settings.cache_clear()
    from kombu import pools

    import tasks

    # NOTE: the app caches its broker connection pool, and conf.broker_url already reads the new
    # CELERY_BROKER_URL from os.environ: drop the pools always, so that a stack on another broker
    # (redis <-> amqp) in the same process never publishes through the previous one.
    pools.reset()  # closes every pooled connection and forgets the pools
    tasks.app._pool = None
    tasks.app.amqp._producer_pool = None
    tasks.app.conf.update(broker_url=env["CELERY_BROKER_URL"], result_backend=env["CELERY_RESULT_BACKEND"])
    if env["CELERY_BROKER_URL"].startswith("amqp"):
        # The workers' broker options (queue types above all: RabbitMQ refuses to redeclare a
        # queue with another type) come from celeryconfig; this process must send with the same.
        import celeryconfig

        tasks.app.conf.update(celeryconfig.build())
    # The queue declarations are built once from the configuration of the first use (a Redis
    # stack declares classic queues): rebuild them from the configuration now in force.
    for cached in ("queues", "router", "default_queue"):
        tasks.app.amqp.__dict__.pop(cached, None)
    tasks.app.amqp._rtable = None


def flush_broker(redis_base: str | None = None, broker: str | None = None) -> None:
    """Every queued message, result and event of the stack is gone (I7: nothing is lost)."""
    import redis

    for db in (BROKER_DB, BACKEND_DB, EVENTS_DB):
        client = redis.Redis.from_url(f"{redis_base or REDIS_BASE}/{db}")
        client.flushdb()
        client.close()
    if (broker or stack_broker()) == "amqp":
        purge_amqp()


def purge_amqp(url: str = AMQP_URL, queues: tuple[str, ...] = AMQP_QUEUES) -> dict[str, int]:
    """Delete the stack's RabbitMQ queues with their messages (ready and unacked alike); the next
    worker declares them again, with the queue type the configuration asks for. Returns the
    messages each held. A queue that does not exist is skipped."""
    from amqp.exceptions import NotFound
    from kombu import Connection

    dropped: dict[str, int] = {}
    with Connection(url, connect_timeout=5) as conn:
        channel = conn.channel()
        for name in queues:
            try:
                channel.queue_declare(name, passive=True)
            except NotFound:
                channel = conn.channel()  # a failed passive declare closes the channel
                continue
            dropped[name] = int(channel.queue_delete(name) or 0)
        channel.close()
    return dropped


class Service:
    """A subprocess in its own process group, its output in ``log_path``; ready once its log
    shows ``ready_line`` (when given). kill() is a SIGKILL of the whole group: no cleanup, no
    acks, nothing flushed; stop() is SIGTERM, then SIGKILL after 10 s."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, ready_line: str | None) -> None:
        self.cmd, self.env, self.log_path, self.ready_line = cmd, env, log_path, ready_line
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Service:
        self._fh = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, env=self.env, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        if self.ready_line is None:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[1:5]} exited early:\n{self.log()[-3000:]}")
            if self.ready_line in self.log():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"{self.cmd[1:5]} not ready after {timeout:g}s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "_fh", None):
            self._fh.close()

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


#: The ``celery`` command of this interpreter's environment: workers are started exactly as an
#: operator starts them (``celery -A tasks worker ...``), not through ``python -m``.
CELERY = str(Path(sys.executable).with_name("celery"))


#: Pools a Worker may start (Celery's ``-P``): ``prefork`` (one loop per process; the crash
#: suite's default, whose points count per pool process), ``threads`` (many loops per
#: process: the Procfile's ``worker`` line, docs/scaling.md) and ``gevent`` (measured by
#: bench/scale.py only: it needs the ``gevent`` and ``psycogreen`` packages, not dependencies).
POOLS = ("prefork", "threads", "gevent")
#: What a Worker runs when its caller names no pool or size: the Procfile's lines. A worker of
#: the ``celery`` queue (or a bare one, which serves it too) runs agent loops on threads; the
#: dedicated ``recovery`` worker keeps prefork (``-P prefork -c 2``).
PROCFILE_POOL = {"celery": "threads", "recovery": "prefork"}
#: Each pool's ``-c`` in the Procfile, for a Worker started without ``concurrency``.
PROCFILE_CONCURRENCY = {"threads": 256, "prefork": 2}


class Worker(Service):
    """``celery -A tasks worker -P POOL -c N -n NAME@%h`` (optionally with an embedded beat,
    -B). Without ``queues`` the worker is started bare, as Celery's docs, our README and
    docs/operations.md start
    it, and serves every queue the app declares; ``queues`` adds ``-Q`` (e.g. the dedicated
    recovery worker). ``argv`` replaces the whole command line after ``celery`` (a Procfile
    line, verbatim). Without ``pool`` (and ``concurrency``), the worker runs as the Procfile
    runs its queue (``PROCFILE_POOL``): threads -c 256, or prefork -c 2 for ``queues="recovery"``."""

    def __init__(
        self,
        env: dict[str, str],
        log_dir: Path,
        name: str = "w1",
        concurrency: int | None = None,
        beat: bool = False,
        *,
        queues: str | None = None,
        argv: list[str] | None = None,
        pool: str | None = None,
    ) -> None:
        pool = pool or PROCFILE_POOL["recovery" if queues == "recovery" else "celery"]
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}")
        concurrency = concurrency or PROCFILE_CONCURRENCY[pool]
        self.name, self.concurrency, self.beat, self.pool = name, concurrency, beat, pool
        log_path = log_dir / f"worker-{name}-{int(time.time() * 1000)}.log"
        if argv is not None:
            cmd = [CELERY, *argv]
        else:
            cmd = [CELERY, "-A", "tasks", "worker", "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h"]
            if queues:
                cmd += ["-Q", queues]
            cmd += ["--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"]
        if beat:
            cmd += ["-B", "-s", str(log_path.with_suffix(".beat"))]
        super().__init__(cmd, env, log_path, "event=worker_ready")

    def start(self, timeout: float = 30.0) -> Worker:
        super().start(timeout)
        return self


def procfile_commands(path: Path = ROOT / "Procfile") -> dict[str, list[str]]:
    """The Procfile's process lines as argv lists after ``celery`` (``{"worker": ["-A", ...]}``),
    so that tests start workers exactly as the Procfile writes them."""
    import shlex

    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        name, sep, command = line.partition(":")
        if not sep or line.startswith("#") or not name.strip().isidentifier():
            continue
        argv = shlex.split(command)
        if argv and argv[0] == "celery":
            out[name.strip()] = argv[1:]
    return out


def procfile_workers(
    env: dict[str, str], log_dir: Path, *, concurrency: int | None = None, path: Path = ROOT / "Procfile"
) -> list[Worker]:
    """A Worker for each of the Procfile's ``celery ... worker`` lines (``worker`` and
    ``recovery``), each started with that line's arguments verbatim, so that a bench runs the
    topology production runs and cannot drift from it. ``concurrency`` replaces the ``-c`` of
    the lines that serve the ``celery`` queue (a ``-Q`` naming it, or none): the agent loops'
    size, to measure another; their pool, queues and names stay the Procfile's. Not started."""
    out = []
    for name, argv in procfile_commands(path).items():
        if "worker" not in argv:
            continue
        argv = list(argv)
        queues = argv[argv.index("-Q") + 1].split(",") if "-Q" in argv else ["celery"]
        if concurrency is not None and "celery" in queues:
            if "-c" in argv:
                argv[argv.index("-c") + 1] = str(concurrency)
            else:
                argv += ["-c", str(concurrency)]
        out.append(Worker(env, log_dir, name=name, argv=argv))
    return out


class Beat(Service):
    """`celery -A tasks beat`: sends recovery.scan every SCAN_INTERVAL_SECONDS."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        log_path = log_dir / f"beat-{int(time.time() * 1000)}.log"
        cmd = [
            CELERY,
            "-A",
            "tasks",
            "beat",
            "-l",
            "INFO",
            "-s",
            str(log_path.with_suffix(".schedule")),
        ]
        super().__init__(cmd, env, log_path, None)

    def start(self, timeout: float = 30.0) -> Beat:
        super().start(timeout)
        return self
