"""The console's operators: who may sign in, as whom, and what each may do (docs/console.md,
"Operators").

``CONSOLE_OPERATORS_FILE`` (TOML, or JSON when its name ends in ``.json``) lists each operator's
name, role and a hash of their token, never the token::

    [[operators]]
    name = "alice"
    role = "approver"            # viewer | approver | admin
    token_hash = "scrypt$16384$8$1$<salt>$<key>"   # agent-recovery console hash-token

A token is checked with scrypt (``hashlib.scrypt``, a random 16-byte salt per hash) or
PBKDF2-SHA256 (``pbkdf2_sha256$<iterations>$<salt>$<key>``), the derived keys compared with
``hmac.compare_digest``. A name that is not in the file costs the same derivation (against a
hash made at start), so a refusal does not tell whether the name exists.

Deriving a key costs tens of milliseconds on purpose: an API client that sends its token with
every request is checked once, then found in a small in-memory table keyed by an HMAC (under a
key of this process) of the name, the token and the stored hash, so a changed hash or a removed
operator is never served from it. The file is read again when its modification time changes
(looked at no more than every RELOAD_CHECK_SECONDS); a file that no longer reads keeps the
operators read last, and says so in the log.

This module needs only the standard library: ``agent-recovery console hash-token`` uses it
without the console's extra.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
import tomllib
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from logfmt import log_event

log = logging.getLogger(__name__)


class Role(StrEnum):
    """What an operator may do in the console."""

    VIEWER = "viewer"  #: sees every page; no action
    APPROVER = "approver"  #: also approves and denies tool calls
    ADMIN = "admin"  #: also cancels sessions and redelivers results


#: The actions each role may take (the console's action names).
ALLOWED: dict[Role, frozenset[str]] = {
    Role.VIEWER: frozenset(),
    Role.APPROVER: frozenset({"approve", "deny"}),
    Role.ADMIN: frozenset({"approve", "deny", "cancel", "redeliver"}),
}


def allows(role: Role, action: str) -> bool:
    return action in ALLOWED[role]


class OperatorsFileError(ValueError):
    """Raised when the operators file cannot be read or names an operator wrongly."""


# --- token hashes -----------------------------------------------------------------------------

#: scrypt's cost: 2**14 blocks of 8 x 128 bytes (16 MiB), one lane: tens of ms per check.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
_SCRYPT_MAXMEM = 64 * 1024 * 1024
#: The least PBKDF2-SHA256 iterations a hash may name (a weaker one is refused at start).
MIN_PBKDF2_ITERATIONS = 100_000
_NAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def hash_token(token: str) -> str:
    """``scrypt$N$r$p$<salt>$<key>`` of ``token`` with a fresh random salt."""
    salt = secrets.token_bytes(16)
    key = hashlib.scrypt(token.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, maxmem=_SCRYPT_MAXMEM)
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${_b64(salt)}${_b64(key)}"


#: PBKDF2-SHA256 iterations of a hash made here (OWASP's figure for SHA-256).
PBKDF2_ITERATIONS = 600_000


def hash_token_pbkdf2(token: str) -> str:
    """``pbkdf2_sha256$<iterations>$<salt>$<key>`` of ``token`` with a fresh random salt."""
    salt = secrets.token_bytes(16)
    key = hashlib.pbkdf2_hmac("sha256", token.encode(), salt, PBKDF2_ITERATIONS)
    return f"pbkdf2_sha256${PBKDF2_ITERATIONS}${_b64(salt)}${_b64(key)}"


def _derive(token: str, stored: str) -> tuple[bytes, bytes]:
    """(the key ``token`` derives under ``stored``'s parameters, the key ``stored`` holds).
    Raises OperatorsFileError when ``stored`` is not a hash this module makes or reads."""
    parts = stored.split("$")
    try:
        if parts[0] == "scrypt" and len(parts) == 6:
            n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
            salt, key = _unb64(parts[4]), _unb64(parts[5])
            derived = hashlib.scrypt(token.encode(), salt=salt, n=n, r=r, p=p, dklen=len(key), maxmem=_SCRYPT_MAXMEM)
            return derived, key
        if parts[0] == "pbkdf2_sha256" and len(parts) == 4:
            iterations, salt, key = int(parts[1]), _unb64(parts[2]), _unb64(parts[3])
            if iterations < MIN_PBKDF2_ITERATIONS:
                raise OperatorsFileError(f"pbkdf2_sha256 needs at least {MIN_PBKDF2_ITERATIONS} iterations")
            return hashlib.pbkdf2_hmac("sha256", token.encode(), salt, iterations, dklen=len(key)), key
    except (ValueError, TypeError) as exc:
        if isinstance(exc, OperatorsFileError):
            raise
        raise OperatorsFileError("token_hash is not a scrypt or pbkdf2_sha256 hash") from None
    raise OperatorsFileError("token_hash is not a scrypt or pbkdf2_sha256 hash")


def token_matches(token: str, stored: str) -> bool:
    """True when ``token`` is the one ``stored`` was made from (constant-time comparison)."""
    derived, key = _derive(token, stored)
    return bool(key) and hmac.compare_digest(derived, key)


# --- the file ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Operator:
    name: str
    role: Role
    token_hash: str


def read_operators(path: str) -> dict[str, Operator]:
    """The operators of ``path`` by name. Raises OperatorsFileError naming what is wrong (never a
    hash's value): the file unreadable, not TOML/JSON, a name that is not letters, digits and
    ``._@-`` (64 at most) or is repeated, a role not in Role, a hash this module cannot check."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise OperatorsFileError(f"CONSOLE_OPERATORS_FILE cannot be read ({type(exc).__name__})") from None
    try:
        data: Any = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        kind = "JSON" if path.endswith(".json") else "TOML"
        raise OperatorsFileError(f"CONSOLE_OPERATORS_FILE is not valid {kind}: {exc}") from None
    entries = data.get("operators") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise OperatorsFileError("CONSOLE_OPERATORS_FILE must hold a list of operators ([[operators]])")
    found: dict[str, Operator] = {}
    for i, entry in enumerate(entries, 1):
        found_one = _operator(entry, i)
        if found_one.name in found:
            raise OperatorsFileError(f"operator {found_one.name!r} is listed twice")
        found[found_one.name] = found_one
    return found


def _operator(entry: Any, index: int) -> Operator:
    if not isinstance(entry, dict):
        raise OperatorsFileError(f"operator {index}: not a table of name, role and token_hash")
    name, role, stored = entry.get("name"), entry.get("role"), entry.get("token_hash")
    if not isinstance(name, str) or not _NAME.match(name):
        raise OperatorsFileError(f"operator {index}: name must be 1-64 letters, digits or ._@-")
    if role not in tuple(Role):
        raise OperatorsFileError(f"operator {name!r}: role must be one of {', '.join(Role)}")
    if not isinstance(stored, str):
        raise OperatorsFileError(f"operator {name!r}: token_hash is missing")
    try:
        _derive("", stored)  # its shape and parameters are checked once, at read
    except OperatorsFileError as exc:
        raise OperatorsFileError(f"operator {name!r}: {exc}") from None
    return Operator(name=name, role=Role(role), token_hash=stored)


#: The file's modification time is looked at no more often than this.
RELOAD_CHECK_SECONDS = 2.0
#: Verified (name, token) pairs kept in memory at most (the oldest forgotten first).
MAX_VERIFIED = 1024


class Operators:
    """The operators of CONSOLE_OPERATORS_FILE as the console uses them (thread-safe)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._by_name = read_operators(path)
        self._mtime = self._modified()
        self._checked = time.monotonic()
        #: Signs sign-in cookies (with the operator's stored hash): a restart signs everyone out.
        self._secret = secrets.token_bytes(32)
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._decoy = hash_token(secrets.token_urlsafe(16))

    def _modified(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime
        except OSError:
            return None

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_SECONDS:
            return
        self._checked = now
        mtime = self._modified()
        if mtime == self._mtime:
            return
        try:
            self._by_name = read_operators(self.path)
        except OperatorsFileError as exc:
            log_event(log, "console_operators_not_reloaded", logging.ERROR, reason=str(exc)[:200])
        else:
            self._verified.clear()
            log_event(log, "console_operators_reloaded", operators=len(self._by_name))
        self._mtime = mtime

    def get(self, name: str) -> Operator | None:
        with self._lock:
            self._refresh()
            return self._by_name.get(name)

    def authenticate(self, name: str, token: str) -> Operator | None:
        """The operator ``name`` when ``token`` is theirs, else None (the same derivation is made
        for a name not in the file)."""
        operator = self.get(name)
        stored = operator.token_hash if operator is not None else self._decoy
        seen = hmac.new(self._secret, f"{name}\0{stored}\0{token}".encode(), hashlib.sha256).digest()
        with self._lock:
            if operator is not None and seen in self._verified:
                self._verified.move_to_end(seen)
                return operator
        if not token_matches(token, stored) or operator is None:
            return None
        with self._lock:
            self._verified[seen] = None
            while len(self._verified) > MAX_VERIFIED:
                self._verified.popitem(last=False)
        return operator

    def cookie_key(self, operator: Operator) -> str:
        """The key a sign-in cookie of ``operator`` is signed with: a new hash (a changed token)
        or a restart of the console ends the sign-ins made before."""
        return hmac.new(self._secret, operator.token_hash.encode(), hashlib.sha256).hexdigest()
