"""Finding handler modules: named on the command line or in WORKER_HANDLERS, or installed.

A handler module exposes a ``router`` (a ``worker.Router``). An installed package plugs in
through the ``worker.handlers`` entry-point group; each entry point names a module or a router
(``package.module`` or ``package.module:router``). Every entry point installed is loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from importlib.metadata import entry_points

from worker.core.router import Router
from worker.errors import ConfigurationError

ENTRY_POINT_GROUP = "worker.handlers"


def load_router_from(target: str) -> Router:
    """The router named by ``module`` or ``module:attribute``."""
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import handler module {module_name!r}: {exc}") from exc
    obj = getattr(module, attribute or "router", None)
    if not isinstance(obj, Router):
        raise ConfigurationError(
            f"{target!r} has no Router named {attribute or 'router'!r}; "
            "a handler module must define `router = Router(...)`"
        )
    if obj.name is None:
        obj.name = module_name.rsplit(".", 1)[-1]
    return obj


def installed_targets() -> list[str]:
    """The ``module[:attribute]`` of every installed ``worker.handlers`` entry point."""
    return [ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)]


def load_routers(targets: Iterable[str], *, include_installed: bool = True) -> Router:
    """One router serving the handlers of every named module and every installed plugin."""
    combined = Router()
    seen: set[int] = set()
    names = list(targets) + (installed_targets() if include_installed else [])
    for target in dict.fromkeys(names):
        router = load_router_from(target)
        if id(router) not in seen:
            seen.add(id(router))
            combined.include(router)
    return combined
