"""The console's HTTP application (starlette): pages under ``/``, the JSON API under ``/api``.

The API paths are a public interface:

- ``GET /api/sessions``: filters ``phase``, ``agent``, ``user``, ``waiting_approval``,
  ``recovered``, ``failed`` (true/false), ``failure_code`` (why a session stopped:
  docs/providers.md), ``since``, ``until`` (ISO 8601, on started_at);
  paging ``limit`` and ``before`` (the ``next_before`` of the previous page); newest first.
- ``GET /api/sessions/{id}``: the tree, its executions, the rounds as a timeline.
- ``GET /api/approvals``, ``GET /api/health``, ``GET /api/csrf``.
- ``POST /api/sessions/{id}/cancel``, ``POST /api/sessions/{id}/redeliver`` (every pending
  result of a parent), ``POST /api/executions/{id}/redeliver``,
  ``POST /api/approvals/{id}/approve`` (``for_session``: true approves its tool for the rest of its
  session; ``arguments``: a budget request's amounts, e.g. ``{"tokens": 50000}``, instead of
  the request's), ``POST /api/approvals/{id}/deny`` (``reason``), ``POST /api/approvals/decide``
  (``ids``, ``decision``, ``reason``, ``for_session``: one decision for several requests, each
  its own compare-and-set; the answer lists each one's outcome).

Every POST needs the CSRF token; CONSOLE_READ_ONLY refuses them all (403) and the pages show
no action. The pages post the same actions as forms and are sent back to where they were.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from console import actions, approvals, auth, queries
from console.auth import ConsoleConfig
from console.gate import Gate, actor, audit, login, logout
from console.render import HERE, config, context, templates
from logfmt import log_event

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """Raised when a query parameter cannot be read; answered 400 naming the parameter."""


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
        failure_code=_text(request, "failure_code"),
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
        return queries.session_detail(s, session_id, show_content=config(request).show_content, children_offset=offset)


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
    show_content = config(request).show_content
    with queries.read_only() as s:
        page = approvals.pending(s, f, show_content=show_content)
        ids = sorted({r["session_id"] for r in page["approvals"]})
        children = queries.children_counts(s, ids)
        tasks = queries.child_tasks(s, ids) if show_content else {}
    for row in page["approvals"]:
        row["children"] = children.get(row["session_id"], 0)
        if row["session_id"] in tasks:
            row["task"] = tasks[row["session_id"]]  # a child's task: users' data, as the arguments
    return {"installed": approvals.installed(), **page}


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


def _releases() -> dict[str, Any]:
    with queries.read_only() as s:
        return queries.releases(s)


def api_releases(request: Request) -> Response:
    return JSONResponse(_releases())


def page_releases(request: Request) -> Response:
    return templates.TemplateResponse(request, "releases.html", context(request, r=_releases()))


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
        got = await request.form()
        form = {k: str(v) for k, v in got.items()}
        if "ids" in got:  # the approvals page's selection: one field per checked request
            form["ids"] = ",".join(str(v) for v in got.getlist("ids"))
    elif request.headers.get("content-type", "").startswith("application/json"):
        try:
            body = await request.json()
        except ValueError:
            body = None
        if isinstance(body, dict):
            form = {k: v for k, v in body.items() if isinstance(v, str)}
            ids = body.get("ids")
            if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                form["ids"] = ",".join(str(i) for i in ids)
            if body.get("for_session") is True:
                form["for_session"] = "true"
            if isinstance(body.get("arguments"), dict):  # a budget request's amounts
                form["arguments"] = json.dumps(body["arguments"])
    if config(request).read_only:
        return _action_error(request, "read_only"), form
    sent = request.headers.get(auth.CSRF_HEADER) or form.get(auth.CSRF_FIELD)
    if not auth.csrf_ok(request.cookies.get(auth.CSRF_COOKIE), sent):
        return _action_error(request, "csrf"), form
    return None, form


def _may(request: Request, action: str) -> bool:
    """The signed-in operator's role allows ``action`` (console.operators.ALLOWED)."""
    from console.operators import allows

    role = getattr(request.state, "role", None)
    return role is not None and allows(role, action)


def _action_error(request: Request, error: str) -> str:
    log_event(log, "console_action_refused", path=request.url.path, reason=error, actor=actor(request))
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
        if refusal is None and not _may(request, name):
            # The operators file's role does not reach this action: the attempt is recorded.
            refusal = _action_error(request, "forbidden")
            await run_in_threadpool(audit, actor(request), action=name, **{target: _id(request)}, outcome=refusal)
        if refusal is not None:
            if request.url.path.startswith("/api/"):
                return JSONResponse({"error": refusal}, status_code=403)
            return _back_to(back(request), refusal, status_ok=False, form=form, request=request)
        result = await run_in_threadpool(run, request, form)
        fields: dict[str, Any] = {"action": name, target: _id(request), "outcome": result.outcome}
        log_event(log, "console_action", **fields, status=result.status, operator=request.state.operator)
        if audited_here:
            await run_in_threadpool(audit, actor(request), **fields)
        return _respond(request, result, back(request), form)

    return endpoint


def _id(request: Request) -> int:
    return int(request.path_params["id"])


def _session_page(request: Request) -> str:
    return f"/sessions/{_id(request)}"


def _execution_back(request: Request) -> str:
    back = request.query_params.get("back", "")
    return back if back.startswith("/sessions/") else "/"


cancel = _action("cancel", "session_id", lambda r, f: actions.cancel(_id(r), actor(r)), _session_page)
redeliver_parent = _action(
    "redeliver", "session_id", lambda r, f: actions.redeliver_parent(_id(r), actor(r)), _session_page
)
redeliver_execution = _action(
    "redeliver", "execution_id", lambda r, f: actions.redeliver_execution(_id(r), actor(r)), _execution_back
)
#: The Approve form's inputs of a budget request's amounts, each naming its kind.
AMOUNT_FIELDS = {"raise_tokens": "tokens", "raise_usd": "usd", "raise_model_calls": "model_calls"}


def _amount(raw: str) -> Any:
    """An amount input's number (an integer when it reads as one); the text itself when it is no
    finite number, for the decision's schema check to refuse."""
    raw = raw.strip()
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        value = float(raw)
    except ValueError:
        return raw
    return value if math.isfinite(value) else raw


def _edited(form: dict[str, str]) -> str | dict[str, Any] | None:
    """The amounts an approver sent for a budget request: the API's ``arguments`` (a JSON
    object, or its text), else the Approve form's ``raise_KIND`` inputs; None: none sent (the
    request's own amounts stand)."""
    if "arguments" in form:
        return form["arguments"]
    amounts = {kind: _amount(form[field]) for field, kind in AMOUNT_FIELDS.items() if field in form}
    return amounts or None


approve = _action(
    "approve",
    "request_id",
    lambda r, f: actions.decide(
        _id(r),
        approve=True,
        reason=f.get("reason", ""),
        actor=actor(r),
        for_session=f.get("for_session") == "true",
        arguments=_edited(f),
    ),
    lambda r: "/approvals",
    audited_here=False,
)
deny = _action(
    "deny",
    "request_id",
    lambda r, f: actions.decide(_id(r), approve=False, reason=f.get("reason", ""), actor=actor(r)),
    lambda r: "/approvals",
    audited_here=False,
)


def _selected(form: dict[str, str]) -> list[int] | None:
    """The ``ids`` of a selection (a form's checked boxes, a JSON list); None when one is not a number."""
    try:
        return [int(i) for i in form.get("ids", "").split(",") if i.strip()]
    except ValueError:
        return None


async def decide_selected(request: Request) -> Response:
    """One decision (``decision``: approve or deny; ``reason``; ``for_session``) for the selected
    requests (``ids``), each its own compare-and-set: the answer lists each one's outcome; the
    page shows them. Refused like every action (read-only, CSRF)."""
    from starlette.concurrency import run_in_threadpool

    refusal, form = await _refused(request)
    api = request.url.path.startswith("/api/")
    ids, decision = _selected(form), form.get("decision", "")
    if refusal is None and (ids is None or decision not in ("approve", "deny")):
        refusal = "bad_selection"
    if refusal is not None or ids is None:
        if api:
            return JSONResponse({"error": refusal}, status_code=400 if refusal == "bad_selection" else 403)
        return RedirectResponse(f"/approvals?{urlencode({'outcome': refusal})}", status_code=303)
    result = await run_in_threadpool(
        lambda: actions.decide_selected(
            ids,
            approve=decision == "approve",
            reason=form.get("reason", ""),
            actor=actor(request),
            for_session=form.get("for_session") == "true",
        )
    )
    for one in result.detail.get("results", []):
        log_event(
            log,
            "console_action",
            action=decision,
            request_id=one["id"],
            outcome=one["outcome"],
            status=one["status"],
            operator=request.state.operator,
        )
    if api:
        return JSONResponse(result.body(), status_code=result.status)
    shown = ",".join(f"{one['id']}:{one['outcome']}" for one in result.detail.get("results", []))
    return RedirectResponse(f"/approvals?{urlencode({'outcome': result.outcome, 'results': shown})}", status_code=303)


# --- pages ------------------------------------------------------------------------------------


def page_sessions(request: Request) -> Response:
    """The list; with ``id``, straight to that session's page (found by its id)."""
    wanted = _int(request, "id")
    if wanted is not None:
        return RedirectResponse(f"/sessions/{wanted}", status_code=303)
    page = _page(request)
    query = {k: v for k, v in request.query_params.items() if k != "before"}
    return templates.TemplateResponse(request, "sessions.html", context(request, page=page, query=query))


def page_session(request: Request) -> Response:
    detail = _detail(request, _id(request))
    if detail is None:
        return templates.TemplateResponse(request, "missing.html", context(request, what="session"), status_code=404)
    outcome = request.query_params.get("outcome")
    return templates.TemplateResponse(
        request, "session.html", context(request, d=detail, outcome=outcome, page_size=queries.CHILDREN_PAGE)
    )


def page_session_live(request: Request) -> Response:
    """The live part of a session's page (tree and timeline), polled by static/console.js:
    ``304 Not Modified`` (no body) when it is what the client's ``If-None-Match`` names."""
    detail = _detail(request, _id(request))
    if detail is None:
        return HTMLResponse("", status_code=404)
    values = context(request, d=detail, page_size=queries.CHILDREN_PAGE)
    response = templates.TemplateResponse(request, "_live.html", values)
    etag = '"' + hashlib.sha256(bytes(response.body)).hexdigest()[:32] + '"'
    if etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers={"ETag": etag})
    response.headers["ETag"] = etag
    return response


def page_health(request: Request) -> Response:
    return templates.TemplateResponse(request, "health.html", context(request, h=_health()))


def page_approvals(request: Request) -> Response:
    outcome = request.query_params.get("outcome")
    query = {k: v for k, v in request.query_params.items() if k in ("tool", "agent", "session", "limit")}
    kept = {"kept_for": _int(request, "request"), "kept_reason": request.query_params.get("reason", "")}
    results = [
        {"id": rid, "outcome": what}
        for rid, _, what in (one.partition(":") for one in request.query_params.get("results", "").split(",") if one)
    ]
    return templates.TemplateResponse(
        request,
        "approvals.html",
        context(request, a=_approvals(request), outcome=outcome, query=query, results=results, **kept),
    )


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
        Route("/releases", page_releases),
        Route(f"/sessions/{num}/cancel", cancel, methods=["POST"]),
        Route(f"/sessions/{num}/redeliver", redeliver_parent, methods=["POST"]),
        Route(f"/executions/{num}/redeliver", redeliver_execution, methods=["POST"]),
        Route(f"/approvals/{num}/approve", approve, methods=["POST"]),
        Route(f"/approvals/{num}/deny", deny, methods=["POST"]),
        Route("/approvals/decide", decide_selected, methods=["POST"]),
        Route("/api/sessions", api_sessions),
        Route(f"/api/sessions/{num}", api_session),
        Route("/api/approvals", api_approvals),
        Route("/api/releases", api_releases),
        Route("/api/health", api_health),
        Route("/api/csrf", api_csrf),
        Route(f"/api/sessions/{num}/cancel", cancel, methods=["POST"]),
        Route(f"/api/sessions/{num}/redeliver", redeliver_parent, methods=["POST"]),
        Route(f"/api/executions/{num}/redeliver", redeliver_execution, methods=["POST"]),
        Route(f"/api/approvals/{num}/approve", approve, methods=["POST"]),
        Route(f"/api/approvals/{num}/deny", deny, methods=["POST"]),
        Route("/api/approvals/decide", decide_selected, methods=["POST"]),
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
