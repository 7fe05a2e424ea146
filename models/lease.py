"""Every duration derived from ``LEASE_SECONDS`` and ``SCAN_INTERVAL_SECONDS``, in one place.

A lease is how long an owner may go silent before its work is taken from it; everything else
that bounds a wait is a fraction or a multiple of it, and is written here only:

- the lease itself, and its renewal interval (a third of it: two renewals may fail before it
  lapses); a lease is renewed only while its holder makes progress: not once a database call of
  the holder has been in flight for half a lease (:func:`stalled_call_seconds`);
- a reservation: how long work handed over without an owner (the scan's re-send, a delivery's
  hand-over, a fresh submit, a child's creation) waits for the task it was handed before the scan
  may take it again: TWO leases, whoever writes it. One lease was too short for a task queued
  behind others; an unclaimed reservation re-sent by the scan doubles at each re-send
  (:func:`resend_window_seconds`), so a long queue is not flooded;
- the right to scan: one scan interval, and never less than a lease, renewed every third of it;
- the server-side bounds of every connection (:func:`connect_bounds`): an idle transaction is
  killed within half a lease, TCP keepalives and ``tcp_user_timeout`` (on both ends) find a
  dead peer within half a lease, the server checks during a statement that its client is still
  there, so that a stalled or vanished client (SIGSTOP, a suspended VM, a path that stopped
  answering) never holds a row past its lease; every lock wait on every path is cut at half a
  lease (:func:`lock_wait_seconds`); and the waits of the scan's statements are shorter still
  (:func:`lock_timeout_seconds`, :func:`statement_timeout_seconds`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import case

from settings import get_settings

#: An unclaimed reservation re-sent by the scan lasts twice as long as the last one, up to
#: 2**MAX_DOUBLINGS reservations.
MAX_DOUBLINGS = 6


def lease_seconds() -> float:
    """How long an owner's lease lasts without a renewal (``LEASE_SECONDS``)."""
    return float(get_settings().LEASE_SECONDS)


def renewal_seconds(lease: float | None = None) -> float:
    """How often a live owner renews its lease (``lease``, default :func:`lease_seconds`): a
    third of it, so that two renewals may fail before it lapses (at least every half second)."""
    return max(0.5, (lease_seconds() if lease is None else lease) / 3)


def stalled_call_seconds(lease: float | None = None) -> float:
    """A holder whose database work has been in flight this long makes no progress: its
    heartbeat renews its lease (``lease``, default :func:`lease_seconds`) no more, so that the
    lease lapses and the scan takes the work back (half a lease: a lock wait is cut at half a
    lease, an idle transaction is ended by the server at half a lease: a live holder's call
    is not longer; one that ends just past it costs one beat, made up by the next)."""
    return (lease_seconds() if lease is None else lease) / 2


def reservation_seconds(lease: float | None = None) -> float:
    """How long an unowned reservation waits for the task it was handed: two leases (``lease``,
    default :func:`lease_seconds`), whoever writes it (the scan, a delivery's hand-over, a fresh
    submit, a child's creation)."""
    return 2 * (lease_seconds() if lease is None else lease)


def resend_window_seconds(resends: int) -> float:
    """The reservation of an unclaimed reservation re-sent for the ``resends``-th time (0: the
    first re-send): twice the last one, 2, 4, ... 2**MAX_DOUBLINGS reservations."""
    return reservation_seconds() * float(2 ** min(resends + 1, MAX_DOUBLINGS))


def reservation_expiry(resends: Any, now: Any, unclaimed: Any, reserve_seconds: float | None = None) -> Any:
    """SQL: the expiry the scan writes when it reserves a row: ``now`` + a reservation
    (``reserve_seconds``, default :func:`reservation_seconds`) for work taken from an owner;
    for an ``unclaimed`` reservation re-sent (its message may just wait in a long queue), the
    window of its ``resends``-th re-send (:func:`resend_window_seconds`)."""
    base = reservation_seconds() if reserve_seconds is None else reserve_seconds
    windows = [(resends == k, now + timedelta(seconds=base * 2 ** (k + 1))) for k in range(MAX_DOUBLINGS - 1)]
    return case(
        (~unclaimed, now + timedelta(seconds=base)),
        *windows,
        else_=now + timedelta(seconds=base * 2**MAX_DOUBLINGS),
    )


def scan_interval_seconds() -> float:
    """How often the beat asks for a scan (``SCAN_INTERVAL_SECONDS``)."""
    return float(get_settings().SCAN_INTERVAL_SECONDS)


def scan_right_seconds() -> float:
    """How long the right to scan lasts without a renewal: one scan interval, never less than
    a lease."""
    return max(scan_interval_seconds(), lease_seconds())


def scan_right_renewal_seconds() -> float:
    """How often a pass renews its right to scan: a third of it (as a lease is renewed). Between
    renewals every batch and step still checks, in its own transaction, that the right is held
    (a read, no commit)."""
    return scan_right_seconds() / 3


def idle_in_transaction_seconds() -> float:
    """A transaction left idle this long is ended by the server, its locks released: half a
    lease, so a stalled client's rows are free before its lease lapses."""
    return lease_seconds() / 2


def lock_wait_seconds() -> float:
    """The longest any statement of ours waits for a row lock (every connection, every path:
    a delivery, a recovery's take, a cancel): half a lease. A holder that stalls with its
    transaction idle is ended by the server in that time anyway; this bounds the waits behind a
    holder that is not idle (a statement stuck, a path that itself waits). A wait cut is an
    infrastructure fault: the task ends without a result and the scan takes the work up."""
    return lease_seconds() / 2


def lock_timeout_seconds() -> float:
    """The longest a scan statement waits for a row lock (the scan skips locked rows; this
    bounds any wait left): a tenth of a lease, at least 100 ms."""
    return max(0.1, lease_seconds() / 10)


def statement_timeout_seconds() -> float:
    """The longest one scan statement runs: one lease (a pass renews its right between
    statements, and the right lasts at least a lease)."""
    return lease_seconds()


def tcp_user_timeout_seconds() -> float:
    """Unacknowledged data on a connection for this long: the peer is dead (half a lease)."""
    return lease_seconds() / 2


def keepalive_probe_seconds() -> int:
    """TCP keepalives on both ends of every connection: the first probe after this long idle,
    then one every this long, 3 of them (a sixth of a lease, at least 1 s: the socket option's
    unit); and how often the server checks, during a statement, that its client is still there
    (``client_connection_check_interval``)."""
    return max(1, int(lease_seconds() / 6))


def server_bounds() -> dict[str, int]:
    """The server's settings of every connection (name: value in the setting's unit, ms or s)
    that bound what a stalled or vanished client holds: ``idle_in_transaction_session_timeout``
    (:func:`idle_in_transaction_seconds`), ``lock_timeout`` (:func:`lock_wait_seconds`), TCP
    keepalives (:func:`keepalive_probe_seconds`, 3 probes), ``tcp_user_timeout``
    (:func:`tcp_user_timeout_seconds`) and ``client_connection_check_interval`` (PostgreSQL
    14+). A vanished client's locks are freed within the lease whether its transaction is idle
    (ended at half a lease), in a statement (the server checks its client every probe
    interval) or waiting for the server's answer to be acknowledged (``tcp_user_timeout``)."""
    probe = keepalive_probe_seconds()
    return {
        "idle_in_transaction_session_timeout": max(1000, int(idle_in_transaction_seconds() * 1000)),
        "lock_timeout": max(1000, int(lock_wait_seconds() * 1000)),
        "tcp_keepalives_idle": probe,
        "tcp_keepalives_interval": probe,
        "tcp_keepalives_count": 3,
        "tcp_user_timeout": max(1000, int(tcp_user_timeout_seconds() * 1000)),
        "client_connection_check_interval": probe * 1000,
    }


def connect_bounds() -> dict[str, object]:
    """libpq connect arguments: :func:`server_bounds` as ``-c name=value`` in the startup
    ``options`` (session-level settings of the connection), and the same keepalives and
    ``tcp_user_timeout`` on the client's own socket. The scan's statements wait less still
    (:func:`lock_timeout_seconds`, set per transaction)."""
    server = server_bounds()
    probe = keepalive_probe_seconds()
    return {
        "options": " ".join(f"-c {name}={value}" for name, value in server.items()),
        "keepalives": 1,
        "keepalives_idle": probe,
        "keepalives_interval": probe,
        "keepalives_count": 3,
        "tcp_user_timeout": server["tcp_user_timeout"],
    }
