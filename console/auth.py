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
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from settings import Settings

SESSION_COOKIE = "console_session"
CSRF_COOKIE = "console_csrf"
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"
OPERATOR_HEADER = "x-console-operator"
#: An operator's name as it may appear in a log line.
_OPERATOR = re.compile(r"[^A-Za-z0-9._@-]")


class ConsoleConfigError(RuntimeError):
    """Raised when the console is asked to listen beyond loopback without a token."""


@dataclass(frozen=True)
class ConsoleConfig:
    """The console's settings, read once at start (settings.py holds the variables)."""

    token: str
    read_only: bool
    show_content: bool
    #: Cookies carry the Secure flag (the console is served over HTTPS, behind a proxy).
    secure_cookies: bool = False

    @property
    def needs_token(self) -> bool:
        return bool(self.token)


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
    if not token and not is_loopback(host):
        raise ConsoleConfigError(
            f"the console listens on {host}, beyond loopback: set CONSOLE_TOKEN or CONSOLE_TOKEN_FILE"
        )
    return ConsoleConfig(
        token=token,
        read_only=settings.CONSOLE_READ_ONLY,
        show_content=settings.CONSOLE_SHOW_CONTENT,
        secure_cookies=secure_cookies,
    )


def clean_operator(name: str | None) -> str:
    """An operator's name fit for a log line (letters, digits and ``._@-``, 64 at most)."""
    cleaned = _OPERATOR.sub("", name or "")[:64]
    return cleaned or "operator"


def session_value(token: str, operator: str) -> str:
    """The session cookie of ``operator``: their name and an HMAC of it under the token."""
    mac = hmac.new(token.encode(), f"console-session:{operator}".encode(), hashlib.sha256).hexdigest()
    return f"{operator}.{mac}"


def operator_of_session(token: str, cookie: str | None) -> str | None:
    """The operator a session cookie names, or None when it was not made with this token."""
    if not cookie or "." not in cookie:
        return None
    operator = cookie.rsplit(".", 1)[0]
    if operator != clean_operator(operator):
        return None
    return operator if hmac.compare_digest(session_value(token, operator), cookie) else None


def bearer_ok(token: str, header: str | None) -> bool:
    if not header or not header.lower().startswith("bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())


def new_csrf() -> str:
    return secrets.token_urlsafe(32)


def csrf_ok(cookie: str | None, sent: str | None) -> bool:
    return bool(cookie) and bool(sent) and hmac.compare_digest(str(cookie), str(sent))
