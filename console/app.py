"""The console's HTTP application (starlette): pages under ``/``, the JSON API under ``/api``.

The API paths are a public interface:

- ``GET /api/sessions``: filters ``phase``, ``agent``, ``user``, ``waiting_approval``,
  ``recovered``, ``failed`` (true/false), ``since``, ``until`` (ISO 8601, on started_at);
  paging ``limit`` and ``before`` (the ``next_before`` of the previous page); newest first.
- ``GET /api/sessions/{id}``: the tree, its executions, the rounds as a timeline.
- ``GET /api/approvals``, ``GET /api/health``, ``GET /api/csrf``.
- ``POST /api/sessions/{id}/cancel``, ``POST /api/sessions/{id}/redeliver`` (every pending
  result of a parent), ``POST /api/executions/{id}/redeliver``,
  ``POST /api/approvals/{id}/approve``, ``POST /api/approvals/{id}/deny`` (``reason``).

Every POST needs the CSRF token; CONSOLE_READ_ONLY refuses them all (403) and the pages show
no action. The pages post the same actions as forms and are sent back to where they were.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from console import actions, approvals, auth, queries
from console.auth import ConsoleConfig
from logfmt import log_event

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent


class _Environment(jinja2.Environment):
    """``row.status`` on the API's dicts looks the key up first (jinja2 tries the attribute
    first, a failed getattr per field: a third of a 200-child page's render time)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute in obj:
            return obj[attribute]
        return super().getattr(obj, attribute)


def _pretty(value: Any) -> str:
    """A JSON value indented, whole (the template escapes it): an approval's arguments."""
    return json.dumps(value, indent=2, ensure_ascii=False)


templates = Jinja2Templates(
    env=_Environment(
        loader=jinja2.FileSystemLoader(str(HERE / "templates")), autoescape=jinja2.select_autoescape(("html",))
    )
)
templates.env.filters["pretty"] = _pretty
#: Paths served without the token: the login form and the static files.
OPEN_PATHS = ("/login", "/static/")


class BadRequest(ValueError):
    """Raised when a query parameter cannot be read; answered 400 naming the parameter."""


def _config(request: Request) -> ConsoleConfig:
    config: ConsoleConfig = request.app.state.config
    return config


# --- who is asking --------------------------------------------------------------------------


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
        response = _refusal(request, config)
        if response is None:
            csrf = request.cookies.get(auth.CSRF_COOKIE)
            request.state.csrf = csrf or auth.new_csrf()
            operator = _operator(request, config)
            if isinstance(operator, Response):
                response = operator
            elif operator is None and not path.startswith(OPEN_PATHS):
                response = _unauthorized(request)
            else:
                request.state.operator = operator or "anonymous"
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


def _operator(request: Request, config: ConsoleConfig) -> str | Response | None:
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
        if auth.bearer_ok(config.token, header):
            _throttle(request).succeeded(_address(request))
            return auth.clean_operator(named or "api")
        _sign_in_refused(request, auth.clean_operator(named or "api"), via="bearer")
        return None
    cookie = request.cookies.get(auth.SESSION_COOKIE)
    return auth.operator_of_session(config.token, cookie, max_age_seconds=config.session_seconds)


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


def _context(request: Request, **extra: Any) -> dict[str, Any]:
    config = _config(request)
    return {
        "csrf": request.state.csrf,
        "operator": getattr(request.state, "operator", None),
        "read_only": config.read_only,
        "show_content": config.show_content,
        "needs_token": config.needs_token,
        "approvals_installed": approvals.installed(),
        **extra,
    }


def _actor(request: Request) -> str:
    return f"console:{request.state.operator}"


# --- reading parameters -----------------------------------------------------------------------


def _flag(request: Request, name: str) -> bool | None:
    raw = request.query_params.get(name, "").strip().lower()
    if raw in ("", "any"):
        return None
    if raw in ("true", "1", "yes", "on"):
        return True
    if raw in ("false", "0", "no", "off"):
        return False
    raise BadRequest(f"{name} must be true or false")


def _when(request: Request, name: str) -> datetime | None:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return None
    try:
        value = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(f"{name} must be an ISO 8601 time") from None
    if value.tzinfo is None:
        from datetime import UTC

        value = value.replace(tzinfo=UTC)
    return value


def _int(request: Request, name: str, default: int | None = None) -> int | None:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer") from None


def _text(request: Request, name: str) -> str | None:
    value = request.query_params.get(name, "").strip()
    if "\x00" in value:
        raise BadRequest(f"{name} must not hold a NUL byte")
    return value or None


def _phase(request: Request) -> str | None:
    """A phase the list can filter on (any case), or NONE for a session not started."""
    value = _text(request, "phase")
    if value is None:
        return None
    if value.upper() not in queries.PHASE_FILTERS:
        raise BadRequest(f"phase must be one of {', '.join(queries.PHASE_FILTERS)}")
    return value.upper()


def _filter(request: Request) -> queries.SessionFilter:
    return queries.SessionFilter(
        phase=_phase(request),
        agent=_text(request, "agent"),
        user=_text(request, "user"),
        waiting_approval=_flag(request, "waiting_approval"),
        recovered=_flag(request, "recovered"),
        failed=_flag(request, "failed"),
        since=_when(request, "since"),
        until=_when(request, "until"),
    )


def _page(request: Request) -> dict[str, Any]:
    f = _filter(request)
    with queries.read_only() as s:
        limit = _int(request, "limit") or queries.DEFAULT_PAGE
        return queries.list_sessions(s, f, limit=limit, before=_int(request, "before"))


def _detail(request: Request, session_id: int) -> dict[str, Any] | None:
    offset = _int(request, "children_offset", 0) or 0
    if offset < 0:
        raise BadRequest("children_offset must be 0 or more")
    with queries.read_only() as s:
        return queries.session_detail(s, session_id, show_content=_config(request).show_content, children_offset=offset)


def _health() -> dict[str, Any]:
    from console.health import health

    with queries.read_only() as s:
        return health(s)


def _approvals(request: Request) -> dict[str, Any]:
    from models.approval import PendingFilter

    f = PendingFilter(
        tool=_text(request, "tool"),
        agent_type=_text(request, "agent"),
        session_id=_int(request, "session"),
        after=_int(request, "after"),
        limit=_int(request, "limit"),
    )
    with queries.read_only() as s:
        return {
            "installed": approvals.installed(),
            **approvals.pending(s, f, show_content=_config(request).show_content),
        }


# --- the JSON API -----------------------------------------------------------------------------


def api_sessions(request: Request) -> Response:
    return JSONResponse(_page(request))


def api_session(request: Request) -> Response:
    detail = _detail(request, int(request.path_params["id"]))
    if detail is None:
        return JSONResponse({"error": "not_found"}, status_code=404)
    return JSONResponse(detail)


def api_approvals(request: Request) -> Response:
    return JSONResponse(_approvals(request))


def api_health(request: Request) -> Response:
    return JSONResponse(_health())


def api_csrf(request: Request) -> Response:
    """The CSRF token of this client (the cookie is set beside it when it had none)."""
    return JSONResponse({"csrf": request.state.csrf})


async def _refused(request: Request) -> tuple[str | None, dict[str, str]]:
    """Read-only mode and the CSRF check, for every action; returns why it is refused (or None)
    and the form fields. A JSON body's field that is not text is left out (a ``"reason": null``
    is no reason)."""
    form: dict[str, str] = {}
    if request.headers.get("content-type", "").startswith(("application/x-www-form-urlencoded", "multipart/")):
        form = {k: str(v) for k, v in (await request.form()).items()}
    elif request.headers.get("content-type", "").startswith("application/json"):
        try:
            body = await request.json()
        except ValueError:
            body = None
        if isinstance(body, dict):
            form = {k: v for k, v in body.items() if isinstance(v, str)}
    if _config(request).read_only:
        return _action_error(request, "read_only"), form
    sent = request.headers.get(auth.CSRF_HEADER) or form.get(auth.CSRF_FIELD)
    if not auth.csrf_ok(request.cookies.get(auth.CSRF_COOKIE), sent):
        return _action_error(request, "csrf"), form
    return None, form


def _action_error(request: Request, error: str) -> str:
    log_event(log, "console_action_refused", path=request.url.path, reason=error, actor=_actor(request))
    return error


#: Longest typed reason a failed page form is sent back with.
_KEPT_REASON_CHARS = 1000


def _back_to(back: str, outcome: str, *, status_ok: bool, form: dict[str, str], request: Request) -> Response:
    """A page's form goes back to its page with the outcome shown; one that did not land
    (refused, or its compare-and-set lost) takes the reason typed with it, to be shown again."""
    query = {"outcome": outcome}
    reason = form.get("reason", "").strip()
    if not status_ok and reason:
        query.update(request=str(_id(request)), reason=reason[:_KEPT_REASON_CHARS])
    return RedirectResponse(f"{back}?{urlencode(query)}", status_code=303)


def _respond(request: Request, result: actions.ActionResult, back: str, form: dict[str, str]) -> Response:
    """JSON for the API; for a page's form, back to the page with the outcome shown."""
    if request.url.path.startswith("/api/"):
        return JSONResponse(result.body(), status_code=result.status)
    return _back_to(back, result.outcome, status_ok=result.status == 200, form=form, request=request)


def _action(
    name: str,
    target: str,
    run: Callable[[Request, dict[str, str]], actions.ActionResult],
    back: Callable[[Request], str],
    *,
    audited_here: bool = True,
) -> Any:
    """An action's endpoint: refused (read-only, CSRF: 403 JSON on the API, back to the page
    for a form) or run, then one ``console_action`` line naming the operator, the action, its
    target (``target``: the id field's name) and outcome, and its ``operator_action`` row
    (``audited_here`` False: the domain function writes it, as a decision's does)."""

    async def endpoint(request: Request) -> Response:
        from starlette.concurrency import run_in_threadpool

        refusal, form = await _refused(request)
        if refusal is not None:
            if request.url.path.startswith("/api/"):
                return JSONResponse({"error": refusal}, status_code=403)
            return _back_to(back(request), refusal, status_ok=False, form=form, request=request)
        result = await run_in_threadpool(run, request, form)
        fields: dict[str, Any] = {"action": name, target: _id(request), "outcome": result.outcome}
        log_event(log, "console_action", **fields, status=result.status, operator=request.state.operator)
        if audited_here:
            await run_in_threadpool(_audit, _actor(request), **fields)
        return _respond(request, result, back(request), form)

    return endpoint


def _audit(actor: str, **fields: Any) -> None:
    """One ``operator_action`` row; an audit that cannot be written is logged, never the
    action's answer (the action itself landed or not already)."""
    from models.operator_action import record_now

    try:
        record_now(actor=actor, **fields)
    except SQLAlchemyError as exc:
        log_event(log, "console_audit_failed", logging.WARNING, action=fields.get("action"), error=type(exc).__name__)


def _id(request: Request) -> int:
    return int(request.path_params["id"])


def _session_page(request: Request) -> str:
    return f"/sessions/{_id(request)}"


def _execution_back(request: Request) -> str:
    back = request.query_params.get("back", "")
    return back if back.startswith("/sessions/") else "/"


cancel = _action("cancel", "session_id", lambda r, f: actions.cancel(_id(r), _actor(r)), _session_page)
redeliver_parent = _action(
    "redeliver", "session_id", lambda r, f: actions.redeliver_parent(_id(r), _actor(r)), _session_page
)
redeliver_execution = _action(
    "redeliver", "execution_id", lambda r, f: actions.redeliver_execution(_id(r), _actor(r)), _execution_back
)
approve = _action(
    "approve",
    "request_id",
    lambda r, f: actions.decide(_id(r), approve=True, reason=f.get("reason", ""), actor=_actor(r)),
    lambda r: "/approvals",
    audited_here=False,
)
deny = _action(
    "deny",
    "request_id",
    lambda r, f: actions.decide(_id(r), approve=False, reason=f.get("reason", ""), actor=_actor(r)),
    lambda r: "/approvals",
    audited_here=False,
)


# --- pages ------------------------------------------------------------------------------------


def page_sessions(request: Request) -> Response:
    page = _page(request)
    query = {k: v for k, v in request.query_params.items() if k != "before"}
    return templates.TemplateResponse(request, "sessions.html", _context(request, page=page, query=query))


def page_session(request: Request) -> Response:
    detail = _detail(request, _id(request))
    if detail is None:
        return templates.TemplateResponse(request, "missing.html", _context(request, what="session"), status_code=404)
    outcome = request.query_params.get("outcome")
    return templates.TemplateResponse(
        request, "session.html", _context(request, d=detail, outcome=outcome, page_size=queries.CHILDREN_PAGE)
    )


def page_session_live(request: Request) -> Response:
    """The live part of a session's page (tree and timeline), polled by static/console.js:
    ``304 Not Modified`` (no body) when it is what the client's ``If-None-Match`` names."""
    detail = _detail(request, _id(request))
    if detail is None:
        return HTMLResponse("", status_code=404)
    context = _context(request, d=detail, page_size=queries.CHILDREN_PAGE)
    response = templates.TemplateResponse(request, "_live.html", context)
    etag = '"' + hashlib.sha256(bytes(response.body)).hexdigest()[:32] + '"'
    if etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers={"ETag": etag})
    response.headers["ETag"] = etag
    return response


def page_health(request: Request) -> Response:
    return templates.TemplateResponse(request, "health.html", _context(request, h=_health()))


def page_approvals(request: Request) -> Response:
    outcome = request.query_params.get("outcome")
    query = {k: v for k, v in request.query_params.items() if k in ("tool", "agent", "session", "limit")}
    kept = {"kept_for": _int(request, "request"), "kept_reason": request.query_params.get("reason", "")}
    return templates.TemplateResponse(
        request, "approvals.html", _context(request, a=_approvals(request), outcome=outcome, query=query, **kept)
    )


async def login(request: Request) -> Response:
    """The sign-in form; each attempt is one ``operator_action`` row (``sign_in``)."""
    from starlette.concurrency import run_in_threadpool

    if request.method == "GET":
        return templates.TemplateResponse(request, "login.html", _context(request, next_path="/", failed=False))
    form = await request.form()
    operator = auth.clean_operator(str(form.get("operator", "")))
    outcome, response = _sign_in(request, form, operator)
    await run_in_threadpool(_audit, f"console:{operator}", action="sign_in", outcome=outcome)
    return response


def _sign_in(request: Request, form: Any, operator: str) -> tuple[str, Response]:
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
        if not auth.bearer_ok(config.token, f"Bearer {token}"):
            _sign_in_refused(request, operator, via="login")
            context = _context(request, next_path=nxt, failed=True)
            return "wrong_token", templates.TemplateResponse(request, "login.html", context, status_code=401)
        _throttle(request).succeeded(_address(request))
    response = RedirectResponse(nxt, status_code=303)
    value = auth.session_value(config.token, operator) if config.needs_token else f"{operator}.local"
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
    await run_in_threadpool(_audit, f"console:{operator}", action="sign_out", outcome="signed_out")
    log_event(log, "console_logout", operator=operator)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(
        auth.SESSION_COOKIE, httponly=True, samesite="strict", secure=_config(request).secure_cookies
    )
    return response


# --- the application --------------------------------------------------------------------------


def _bad_request(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": "bad_request", "detail": str(exc)}, status_code=400)


def _database_down(request: Request, exc: Exception) -> Response:
    log_event(log, "console_database_unavailable", logging.WARNING, error=type(exc).__name__)
    return JSONResponse({"error": "database_unavailable"}, status_code=503)


def create_app(config: ConsoleConfig) -> Starlette:
    num = "{id:int}"
    routes = [
        Route("/", page_sessions),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route(f"/sessions/{num}", page_session),
        Route(f"/sessions/{num}/live", page_session_live),
        Route("/health", page_health),
        Route("/approvals", page_approvals),
        Route(f"/sessions/{num}/cancel", cancel, methods=["POST"]),
        Route(f"/sessions/{num}/redeliver", redeliver_parent, methods=["POST"]),
        Route(f"/executions/{num}/redeliver", redeliver_execution, methods=["POST"]),
        Route(f"/approvals/{num}/approve", approve, methods=["POST"]),
        Route(f"/approvals/{num}/deny", deny, methods=["POST"]),
        Route("/api/sessions", api_sessions),
        Route(f"/api/sessions/{num}", api_session),
        Route("/api/approvals", api_approvals),
        Route("/api/health", api_health),
        Route("/api/csrf", api_csrf),
        Route(f"/api/sessions/{num}/cancel", cancel, methods=["POST"]),
        Route(f"/api/sessions/{num}/redeliver", redeliver_parent, methods=["POST"]),
        Route(f"/api/executions/{num}/redeliver", redeliver_execution, methods=["POST"]),
        Route(f"/api/approvals/{num}/approve", approve, methods=["POST"]),
        Route(f"/api/approvals/{num}/deny", deny, methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(Gate)],
        exception_handlers={BadRequest: _bad_request, SQLAlchemyError: _database_down},
    )
    app.state.config = config
    app.state.throttle = auth.SignInThrottle()
    return app
