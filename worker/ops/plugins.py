"""Finding handler modules: named on the command line or in WORKER_HANDLERS, or installed.

A handler module exposes a ``router`` (a ``worker.Router``). An installed package plugs in
through the ``worker.handlers`` entry-point group; each entry point names a module or a router
(``package.module`` or ``package.module:router``). Every entry point installed is loaded,
unless the deployment turns them off (``installed_handlers``).

A module named by the operator is imported as ``python -m`` would import it: the current
directory is searched first, so ``WORKER_HANDLERS=examples.payments`` works from the repository
root whether the worker is installed editable or not.

Besides its router, a handler module may offer hooks to the operator commands: a module-level
attribute, or the attribute of the same name in its submodule of that name (``invariants`` for
``worker verify``, ``demo`` for ``worker demo``). ``hook`` finds them; the command that uses a
hook says what its value must be.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points
from types import ModuleType

from worker.core.router import Router
from worker.errors import ConfigurationError

ENTRY_POINT_GROUP = "worker.handlers"


def import_module(module_name: str) -> ModuleType:
    """The handler module ``module_name``, imported with the current directory on ``sys.path``
    (first, as ``python -m`` puts it); a ``ConfigurationError`` when it cannot be imported."""
    search_current_directory()
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import handler module {module_name!r}: {exc}") from exc


def search_current_directory() -> None:
    """Put the current directory at the front of ``sys.path`` unless it is already there (as
    ``''`` or by name): the ``worker`` script's own ``sys.path`` starts with its bin directory."""
    cwd = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()


def load_router_from(target: str) -> Router:
    """The router named by ``module`` or ``module:attribute``."""
    module_name, _, attribute = target.partition(":")
    module = import_module(module_name)
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


def module_names(targets: Iterable[str], *, include_installed: bool = True) -> list[str]:
    """The handler modules of ``targets`` (``module`` or ``module:router``) and, with
    ``include_installed``, of every installed entry point: each once, in that order."""
    names = list(targets) + (installed_targets() if include_installed else [])
    return list(dict.fromkeys(target.partition(":")[0] for target in names))


def hook(module_name: str, name: str) -> object | None:
    """The module's attribute ``name``, or that of its submodule ``name``; None when neither
    exists. (A submodule already imported is an attribute of its package: it is looked into.)"""
    module = import_module(module_name)
    value = getattr(module, name, None)
    if value is None and hasattr(module, "__path__"):
        submodule = f"{module_name}.{name}"
        if importlib.util.find_spec(submodule) is not None:
            value = import_module(submodule)
    if isinstance(value, ModuleType):
        value = getattr(value, name, None)
    return value
