"""User tool modules: ``TOOL_MODULES`` and the entry point group ``agent_recovery.tools``.

Every process (worker, beat, CLI, demo) imports them at start, through
``harness.agents.load_at_start``; importing a module registers its ``@tool`` functions.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

from harness.errors import AgentConfigError
from harness.tools.registry import ToolDefinitionError
from logfmt import log_event

log = logging.getLogger(__name__)

#: Installed packages offer tools with ``[project.entry-points."agent_recovery.tools"]``,
#: ``name = "package.module"``: the module is imported like one named in TOOL_MODULES.
ENTRY_POINT_GROUP = "agent_recovery.tools"


class ToolModuleError(AgentConfigError):
    """Raised when a tool module named by TOOL_MODULES or an entry point cannot be imported."""


def module_names(setting: str) -> tuple[str, ...]:
    """The modules of a comma-separated TOOL_MODULES value (blanks ignored)."""
    return tuple(part.strip() for part in setting.split(",") if part.strip())


def load_tool_modules(modules: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """Import every entry point of ENTRY_POINT_GROUP, then ``modules`` (TOOL_MODULES when None).
    Returns the modules imported, in order. Importing twice is harmless (Python caches modules).

    Raises ToolModuleError naming the module when one cannot be imported, and ToolDefinitionError
    (naming the tool and the module) when one defines a tool that cannot be registered.
    """
    import harness.tools.builtins  # noqa: F401  (the built-ins are always there)

    if modules is None:
        from settings import get_settings

        modules = module_names(get_settings().TOOL_MODULES)
    loaded: list[str] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except ToolDefinitionError:
            raise
        except Exception as exc:
            raise ToolModuleError(
                f"tool entry point {ep.name!r} ({ep.value}) cannot be imported: {type(exc).__name__}: {exc}"
            ) from exc
        loaded.append(ep.value)
    for name in modules:
        try:
            importlib.import_module(name)
        except ToolDefinitionError:
            raise
        except Exception as exc:
            raise ToolModuleError(
                f"TOOL_MODULES: module {name!r} cannot be imported: {type(exc).__name__}: {exc}"
            ) from exc
        loaded.append(name)
    if loaded:
        log_event(log, "tool_modules_loaded", modules=loaded)
    return tuple(loaded)
