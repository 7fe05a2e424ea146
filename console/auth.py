"""Who may see and act, for the console.

- A token (CONSOLE_TOKEN, or the first line of CONSOLE_TOKEN_FILE) is required unless the
  console listens on loopback only. With a token, every request but ``/login`` and
  ``/static`` carries it: as ``Authorization: Bearer <token>`` (the API), or as the session
  cookie that ``/login`` sets (the pages), which holds an HMAC of the token, never the token.
  A request without it is answered 401.
- Every action (a POST) carries a CSRF token: the ``console_csrf`` cookie's value, repeated in
  the form field ``csrf`` or the ``X-CSRF-Token`` header (double submit; the cookie is
  SameSite=Strict). ``GET /api/csrf`` hands one to an API client.
- The token never appears in a page, a URL or a log line: it is compared with
  ``hmac.compare_digest`` and never echoed.
- Only requests naming an allowed host are answered (``host_allowed``), token or not: a page
  that rebinds its own name to 127.0.0.1 sends its name as the ``Host``, and is refused.
- Refused sign-ins (a wrong token at ``/login`` or in ``Authorization``) are counted per
  client address (``SignInThrottle``): past FREE_FAILURES, the address waits before its next
  attempt is even checked.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from console.operators import Operators, OperatorsFileError, Role
from settings import Settings

SESSION_COOKIE = "console_session"
CSRF_COOKIE = "console_csrf"
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"
OPERATOR_HEADER = "x-console-operator"
#: An operator's name as it may appear in a log line.
_OPERATOR = re.compile(r"[^A-Za-z0-9._@-]")


#: Names of this machine that no other site can make a browser send (with or without a port).
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
#: Addresses that listen on every interface: they name no host a request may be sent to.
_WILDCARDS = ("0.0.0.0", "::", "")


class ConsoleConfigError(RuntimeError):
    """Raised when the console is asked to listen beyond loopback without a token, or its token
    file or operators file cannot be read."""


@dataclass(frozen=True)
class ConsoleConfig:
    """The console's settings, read once at start (settings.py holds the variables)."""

    token: str
    read_only: bool
    show_content: bool
    #: Cookies carry the Secure flag (the console is served over HTTPS, behind a proxy).
    secure_cookies: bool = False
    #: Host names a request may name (``host_allowed``); a leading dot allows every name under it.
    allowed_hosts: frozenset[str] = field(default=LOOPBACK_NAMES)
    #: A sign-in (the session cookie) lasts this long; then the operator signs in again.
    session_seconds: float = 12 * 3600.0
    #: CONSOLE_OPERATORS_FILE read: each operator signs in as themselves, within their role
    #: (the shared token is then not accepted). None: the shared token, every operator an admin.
    operators: Operators | None = None

    @property
    def needs_token(self) -> bool:
        return bool(self.token) or self.operators is not None

    def role_of(self, operator: str) -> Role | None:
        """What ``operator`` may do: their role in the operators file (None: not listed there
        any more), else admin (the shared token, or a console on loopback without one)."""
        if self.operators is None:
            return Role.ADMIN
        found = self.operators.get(operator)
        return None if found is None else found.role

    def session_key(self, operator: str) -> str | None:
        """The key ``operator``'s sign-in cookie is signed with (None: no such operator)."""
        if self.operators is None:
            return self.token
        found = self.operators.get(operator)
        return None if found is None else self.operators.cookie_key(found)

    def token_ok(self, operator: str, token: str) -> bool:
        """``token`` signs ``operator`` in: theirs in the operators file, else the shared token
        (compared in constant time either way)."""
        if self.operators is None:
            return bearer_ok(self.token, f"Bearer {token}")
        return self.operators.authenticate(operator, token) is not None


def is_loopback(host: str) -> bool:
    if host in ("localhost", "::1"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_config(settings: Settings, host: str, *, secure_cookies: bool = False) -> ConsoleConfig:
    """The console's configuration for listening on ``host``. Raises ConsoleConfigError when
    the host is not loopback and no token is set, or when the token file cannot be read."""
    token = settings.CONSOLE_TOKEN.get_secret_value().strip()
    if not token and settings.CONSOLE_TOKEN_FILE:
        try:
            lines = Path(settings.CONSOLE_TOKEN_FILE).read_text().splitlines()
        except OSError as exc:
            raise ConsoleConfigError(f"CONSOLE_TOKEN_FILE cannot be read ({type(exc).__name__})") from None
        token = lines[0].strip() if lines else ""
    operators = None
    if settings.CONSOLE_OPERATORS_FILE:
        try:
            operators = Operators(settings.CONSOLE_OPERATORS_FILE)
        except OperatorsFileError as exc:
            raise ConsoleConfigError(str(exc)) from None
    if not token and operators is None and not is_loopback(host):
        raise ConsoleConfigError(
            f"the console listens on {host}, beyond loopback: set CONSOLE_OPERATORS_FILE, CONSOLE_TOKEN or "
            "CONSOLE_TOKEN_FILE"
        )
    return ConsoleConfig(
        token=token,
        read_only=settings.CONSOLE_READ_ONLY,
        show_content=settings.CONSOLE_SHOW_CONTENT,
        secure_cookies=secure_cookies,
        allowed_hosts=allowed_hosts(settings.CONSOLE_ALLOWED_HOSTS, host),
        session_seconds=settings.CONSOLE_SESSION_HOURS * 3600.0,
        operators=operators,
    )


def allowed_hosts(setting: str, listen_host: str) -> frozenset[str]:
    """Loopback names, the address listened on (unless it is a wildcard), and the names of
    CONSOLE_ALLOWED_HOSTS (comma-separated), all lower case."""
    named = {_bare(name) for name in setting.split(",") if name.strip()}
    if _bare(listen_host) not in _WILDCARDS:
        named.add(_bare(listen_host))
    return LOOPBACK_NAMES | frozenset(named)


def _bare(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_name(header: str | None) -> str:
    """The name in a ``Host`` header, lower case, without its port (``[::1]:8089`` -> ``::1``)."""
    value = (header or "").strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else ""
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    """True when the request names an allowed host; an empty or missing Host is refused."""
    name = host_name(header)
    if not name:
        return False
    if name in allowed:
        return True
    return any(a.startswith(".") and (name.endswith(a) or name == a[1:]) for a in allowed)


def clean_operator(name: str | None) -> str:
    """An operator's name fit for a log line (letters, digits and ``._@-``, 64 at most)."""
    cleaned = _OPERATOR.sub("", name or "")[:64]
    return cleaned or "operator"


def session_value(token: str, operator: str, issued: int | None = None) -> str:
    """The session cookie of ``operator`` signed in at ``issued`` (Unix seconds, now by
    default): their name, that time, and an HMAC of both under the token."""
    issued = int(time.time()) if issued is None else issued
    mac = hmac.new(token.encode(), f"console-session:{operator}:{issued}".encode(), hashlib.sha256).hexdigest()
    return f"{operator}.{issued}.{mac}"


def operator_of_session(
    token: str | Callable[[str], str | None], cookie: str | None, *, max_age_seconds: float = 12 * 3600.0
) -> str | None:
    """The operator a session cookie names, or None when it was not made with this token (or
    with the key ``token(operator)`` gives: ``ConsoleConfig.session_key``, None for an operator
    not in the operators file) or was made more than ``max_age_seconds`` ago (or in the future:
    a clock's mistake)."""
    parts = (cookie or "").rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    operator, issued = parts[0], int(parts[1])
    if operator != clean_operator(operator) or not 0 <= time.time() - issued <= max_age_seconds:
        return None
    key = token(operator) if callable(token) else token
    if key is None:
        return None
    return operator if hmac.compare_digest(session_value(key, operator, issued), str(cookie)) else None


def bearer_ok(token: str, header: str | None) -> bool:
    if not header or not header.lower().startswith("bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())


def new_csrf() -> str:
    return secrets.token_urlsafe(32)


def csrf_ok(cookie: str | None, sent: str | None) -> bool:
    return bool(cookie) and bool(sent) and hmac.compare_digest(str(cookie), str(sent))


#: Refused sign-ins an address may make before it has to wait.
FREE_FAILURES = 5
#: The first wait; each further refusal doubles it, up to MAX_WAIT_SECONDS.
FIRST_WAIT_SECONDS = 1.0
MAX_WAIT_SECONDS = 60.0
#: Addresses remembered at most (the oldest is forgotten first): a bound on memory.
MAX_ADDRESSES = 10_000


class SignInThrottle:
    """Refused sign-ins per client address, and how long that address waits before its next
    attempt is checked. One per application; used from the event loop only (no lock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: address -> (refusals in a row, monotonic time before which it is not checked)
        self._seen: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def wait_seconds(self, address: str) -> float:
        """Seconds ``address`` still waits (0: its attempt may be checked)."""
        _, until = self._seen.get(address, (0, 0.0))
        return max(0.0, until - self._clock())

    def refused(self, address: str) -> None:
        failures = self._seen.pop(address, (0, 0.0))[0] + 1
        until = 0.0
        if failures >= FREE_FAILURES:
            wait = min(MAX_WAIT_SECONDS, FIRST_WAIT_SECONDS * 2 ** (failures - FREE_FAILURES))
            until = self._clock() + wait
        self._seen[address] = (failures, until)
        while len(self._seen) > MAX_ADDRESSES:
            self._seen.popitem(last=False)

    def succeeded(self, address: str) -> None:
        self._seen.pop(address, None)
