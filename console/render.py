"""How the console renders a page: the templates (with the ``pretty`` filter) and the context
every page gets (the CSRF token, the operator and their role, the console's modes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.templating import Jinja2Templates

from console import approvals
from console.auth import ConsoleConfig

HERE = Path(__file__).resolve().parent


class _Environment(jinja2.Environment):
    """``row.status`` on the API's dicts looks the key up first (jinja2 tries the attribute
    first, a failed getattr per field: a third of a 200-child page's render time)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute in obj:
            return obj[attribute]
        return super().getattr(obj, attribute)


def pretty(value: Any) -> str:
    """A JSON value indented, whole (the template escapes it): an approval's arguments."""
    return json.dumps(value, indent=2, ensure_ascii=False)


templates = Jinja2Templates(
    env=_Environment(
        loader=jinja2.FileSystemLoader(str(HERE / "templates")), autoescape=jinja2.select_autoescape(("html",))
    )
)
templates.env.filters["pretty"] = pretty


def config(request: Request) -> ConsoleConfig:
    """The console's configuration (read once at start, kept on the application)."""
    found: ConsoleConfig = request.app.state.config
    return found


def context(request: Request, **extra: Any) -> dict[str, Any]:
    """What every page's template gets, and ``extra``."""
    from console.operators import allows

    settings = config(request)
    role = getattr(request.state, "role", None)
    return {
        "csrf": request.state.csrf,
        "operator": getattr(request.state, "operator", None),
        "role": role,
        #: Buttons shown: the console is not read-only and the operator's role allows them.
        "can_decide": not settings.read_only and role is not None and allows(role, "approve"),
        "can_act": not settings.read_only and role is not None and allows(role, "cancel"),
        "operators_file": settings.operators is not None,
        "read_only": settings.read_only,
        "show_content": settings.show_content,
        "needs_token": settings.needs_token,
        "approvals_installed": approvals.installed(),
        **extra,
    }
