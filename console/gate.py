"""Who is asking, for the console: the gate every request passes (allowed host names, the
token, the CSRF cookie, the security headers, one log line per request), sign-in and sign-out,
refused sign-ins slowed down, and the audit row of an operator's action (docs/console.md)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from console import auth
from console.auth import ConsoleConfig
from console.render import config as _config
from console.render import context as _context
from console.render import templates
from logfmt import log_event

log = logging.getLogger(__name__)
#: Paths served without the token: the sign-in form and the static files.
OPEN_PATHS = ("/login", "/static/")


#: Headers of every answer: no script but the console's own files (nothing inline), no framing,
#: no MIME sniffing, no Referer leaving the console (docs/console.md, "Headers").
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


class Gate(BaseHTTPMiddleware):
    """The allowed host names (400 for any other ``Host``), the token (401 without it, 429 while
    an address that guessed wrong waits), the CSRF cookie, the security headers, and one log
    line per request (method, path without its query, status, duration, operator: never a
    header, a cookie or a parameter)."""

    async def dispatch(self, request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.monotonic()
        config = _config(request)
        path = request.url.path
        request.state.operator = None
        request.state.role = None
        response = _refusal(request, config)
        if response is None:
            csrf = request.cookies.get(auth.CSRF_COOKIE)
            request.state.csrf = csrf or auth.new_csrf()
            operator = await _operator(request, config)
            if isinstance(operator, Response):
                response = operator
            elif operator is None and not path.startswith(OPEN_PATHS):
                response = _unauthorized(request)
            else:
                request.state.operator = operator or "anonymous"
                request.state.role = config.role_of(operator) if operator else None
                response = await call_next(request)
            if csrf is None:
                response.set_cookie(
                    auth.CSRF_COOKIE,
                    request.state.csrf,
                    httponly=True,
                    samesite="strict",
                    secure=config.secure_cookies,
                )
        response.headers.update(SECURITY_HEADERS)
        if not path.startswith("/static/"):
            response.headers["Cache-Control"] = "no-store"
        log_event(
            log,
            "console_request",
            method=request.method,
            path=path,
            status=response.status_code,
            duration_ms=round((time.monotonic() - started) * 1000),
            operator=request.state.operator,
        )
        return response


def _refusal(request: Request, config: ConsoleConfig) -> Response | None:
    """The answer to a request that names a host the console is not reached by, else None."""
    header = request.headers.get("host")
    if auth.host_allowed(header, config.allowed_hosts):
        return None
    log_event(log, "console_host_refused", logging.WARNING, host=auth.host_name(header)[:100] or None)
    return JSONResponse({"error": "host_not_allowed"}, status_code=400)


def _address(request: Request) -> str:
    return request.client.host if request.client else "-"


async def _operator(request: Request, config: ConsoleConfig) -> str | Response | None:
    """The operator's name; None when a token is required and not shown; a 429 answer when a
    token is shown by an address that must still wait after refused sign-ins."""
    named = request.headers.get(auth.OPERATOR_HEADER)
    if not config.needs_token:
        cookie = request.cookies.get(auth.SESSION_COOKIE)
        return auth.clean_operator(named or (cookie.rsplit(".", 1)[0] if cookie else None) or "local")
    header = request.headers.get("authorization")
    if header is not None:
        throttled = _throttled(request, auth.clean_operator(named or "api"), via="bearer")
        if throttled is not None:
            return throttled
        name = auth.clean_operator(named or "api")
        shown = header[7:].strip() if header.lower().startswith("bearer ") else None
        if shown is not None and await _token_ok(config, name, shown):
            _throttle(request).succeeded(_address(request))
            return name
        _sign_in_refused(request, name, via="bearer")
        return None
    cookie = request.cookies.get(auth.SESSION_COOKIE)
    return auth.operator_of_session(config.session_key, cookie, max_age_seconds=config.session_seconds)


async def _token_ok(config: ConsoleConfig, operator: str, token: str) -> bool:
    """``config.token_ok`` off the event loop when it derives a key (an operators file's hash
    costs tens of milliseconds on purpose): other requests are served meanwhile."""
    if config.operators is None:
        return config.token_ok(operator, token)
    from starlette.concurrency import run_in_threadpool

    return bool(await run_in_threadpool(config.token_ok, operator, token))


def _throttle(request: Request) -> auth.SignInThrottle:
    throttle: auth.SignInThrottle = request.app.state.throttle
    return throttle


def _throttled(request: Request, operator: str, *, via: str) -> Response | None:
    """429 with Retry-After while this address waits after refused sign-ins, else None."""
    wait = _throttle(request).wait_seconds(_address(request))
    if wait <= 0:
        return None
    log_event(
        log,
        "console_login_refused",
        logging.WARNING,
        operator=operator,
        via=via,
        reason="throttled",
        address=_address(request),
    )
    retry = str(max(1, math.ceil(wait)))
    if request.url.path.startswith("/api/") or via == "bearer":
        return JSONResponse({"error": "too_many_refused_sign_ins"}, status_code=429, headers={"Retry-After": retry})
    return templates.TemplateResponse(
        request,
        "login.html",
        _context(request, next_path="/", failed=False, wait_seconds=retry),
        status_code=429,
        headers={"Retry-After": retry},
    )


def _sign_in_refused(request: Request, operator: str, *, via: str) -> None:
    _throttle(request).refused(_address(request))
    log_event(
        log,
        "console_login_refused",
        logging.WARNING,
        operator=operator,
        via=via,
        reason="wrong_token",
        address=_address(request),
    )


def _unauthorized(request: Request) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": "unauthorized"}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
    return templates.TemplateResponse(
        request, "login.html", _context(request, next_path=request.url.path, failed=False), status_code=401
    )


def actor(request: Request) -> str:
    return f"console:{request.state.operator}"


def audit(actor: str, **fields: Any) -> None:
    """One ``operator_action`` row; an audit that cannot be written is logged, never the
    action's answer (the action itself landed or not already)."""
    from models.operator_action import record_now

    try:
        record_now(actor=actor, **fields)
    except SQLAlchemyError as exc:
        log_event(log, "console_audit_failed", logging.WARNING, action=fields.get("action"), error=type(exc).__name__)


async def login(request: Request) -> Response:
    """The sign-in form; each attempt is one ``operator_action`` row (``sign_in``)."""
    from starlette.concurrency import run_in_threadpool

    if request.method == "GET":
        return templates.TemplateResponse(request, "login.html", _context(request, next_path="/", failed=False))
    form = await request.form()
    operator = auth.clean_operator(str(form.get("operator", "")))
    outcome, response = await _sign_in(request, form, operator)
    await run_in_threadpool(audit, f"console:{operator}", action="sign_in", outcome=outcome)
    return response


async def _sign_in(request: Request, form: Any, operator: str) -> tuple[str, Response]:
    """The outcome of one sign-in (``signed_in``, ``csrf``, ``throttled``, ``wrong_token``) and
    its answer."""
    config = _config(request)
    token = str(form.get("token", ""))
    nxt = str(form.get("next", "/"))
    nxt = nxt if nxt.startswith("/") and not nxt.startswith("//") else "/"
    if not auth.csrf_ok(request.cookies.get(auth.CSRF_COOKIE), str(form.get(auth.CSRF_FIELD, ""))):
        # Another site's form would sign this browser in under a name of its choosing.
        log_event(log, "console_login_refused", logging.WARNING, operator=operator, via="login", reason="csrf")
        context = _context(request, next_path=nxt, failed=False, stale=True)
        return "csrf", templates.TemplateResponse(request, "login.html", context, status_code=403)
    if config.needs_token:
        throttled = _throttled(request, operator, via="login")
        if throttled is not None:
            return "throttled", throttled
        if not await _token_ok(config, operator, token):
            _sign_in_refused(request, operator, via="login")
            context = _context(request, next_path=nxt, failed=True)
            return "wrong_token", templates.TemplateResponse(request, "login.html", context, status_code=401)
        _throttle(request).succeeded(_address(request))
    response = RedirectResponse(nxt, status_code=303)
    key = config.session_key(operator)
    value = auth.session_value(key, operator) if config.needs_token and key else f"{operator}.local"
    response.set_cookie(
        auth.SESSION_COOKIE,
        value,
        max_age=int(config.session_seconds),
        httponly=True,
        samesite="strict",
        secure=config.secure_cookies,
    )
    log_event(log, "console_login", operator=operator)
    return "signed_in", response


async def logout(request: Request) -> Response:
    """Sign out: the session cookie is cleared (a POST with the CSRF token, so another site
    cannot sign an operator out)."""
    from starlette.concurrency import run_in_threadpool

    form = await request.form()
    if not auth.csrf_ok(request.cookies.get(auth.CSRF_COOKIE), str(form.get(auth.CSRF_FIELD, ""))):
        return JSONResponse({"error": "csrf"}, status_code=403)
    operator = request.state.operator
    await run_in_threadpool(audit, f"console:{operator}", action="sign_out", outcome="signed_out")
    log_event(log, "console_logout", operator=operator)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(
        auth.SESSION_COOKIE, httponly=True, samesite="strict", secure=_config(request).secure_cookies
    )
    return response
