"""``worker demo``: send a handler module's demo traffic, so a fresh deployment shows its flow.

The traffic is the handler module's own: it declares it through the ``demo`` hook
(``plugins.hook``), an async function in the module itself or in its ``demo`` submodule (the
payments example's ``examples/payments/demo.py``). It takes the ``Settings`` and the command's
``DemoOptions``, publishes, and returns the lines ``worker demo`` prints: what was sent and what
the deployment should show once it has been handled. The worker itself knows no demo traffic.

Which modules: those named in ``handlers`` (default ``DEFAULT_HANDLERS``, the payments example,
importable from the repository root) and the installed ``worker.handlers`` entry points, each
module's hook once, in that order.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from worker.errors import ConfigurationError
from worker.ops import plugins
from worker.settings import Settings

DEFAULT_HANDLERS = ("examples.payments",)
"""The handler modules whose demo ``worker demo`` sends when no handler module is named."""


@dataclass(frozen=True)
class DemoOptions:
    """What ``worker demo`` was asked to send; each module reads what applies to its traffic."""

    count: int = 100
    duplicates: float = 0.2
    accounts: int = 5
    seed: int = 1


Demo = Callable[[Settings, DemoOptions], Awaitable[Sequence[str]]]
"""A handler module's demo traffic: publishes, then returns the lines to print."""


def load_demos(targets: Iterable[str], *, include_installed: bool = True) -> list[Demo]:
    """The ``demo`` hook of every named handler module (``DEFAULT_HANDLERS`` when none is) and,
    with ``include_installed``, of every installed entry point; each once. A
    ``ConfigurationError`` when none of them has one."""
    names = plugins.module_names(
        tuple(targets) or DEFAULT_HANDLERS, include_installed=include_installed
    )
    found: dict[int, Demo] = {}
    for module_name in names:
        if (demo := demo_of(module_name)) is not None:
            found.setdefault(id(demo), demo)
    if not found:
        raise ConfigurationError(
            f"no demo traffic: none of {', '.join(names)} has a `demo` hook "
            "(e.g. --handlers examples.payments, from the repository root)"
        )
    return list(found.values())


def demo_of(module_name: str) -> Demo | None:
    """The ``demo`` hook of the module (``plugins.hook``), or None when it has none."""
    value = plugins.hook(module_name, "demo")
    if value is None:
        return None
    if not inspect.iscoroutinefunction(value):
        raise ConfigurationError(
            f"{module_name}: `demo` must be an async function taking Settings and DemoOptions"
        )
    demo: Demo = value
    return demo


async def send(settings: Settings, options: DemoOptions, demos: Sequence[Demo]) -> list[str]:
    """Run each demo, one after the other; the lines they return, in that order."""
    lines: list[str] = []
    for demo in demos:
        lines.extend(await demo(settings, options))
    return lines
