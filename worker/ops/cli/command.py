"""A command of ``worker`` as data: its name, its help, its own flags, its body and the groups of
settings it reads. Each command module declares its commands beside their bodies; the package
collects them, and dispatch, ``--help``, the settings table and the docs derive from them."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType

from worker.errors import ConfigurationError
from worker.settings import Group, Settings

EVERY_COMMAND = (Group.DEPLOYMENT, Group.LOGGING)
"""The groups every command takes as flags: where the deployment is, and how to log."""

Action = Callable[[Settings, argparse.Namespace], int]
"""A command's body: it reads the settings and its own flags, prints, returns its exit status."""

Options = Callable[[argparse.ArgumentParser], None]
"""Adds a command's own flags (not its settings') to its parser."""


def no_options(parser: argparse.ArgumentParser) -> None:
    """A command with no flags of its own: its settings only."""


@dataclass(frozen=True)
class Command:
    """One command that runs something (``dlq list``: ``list`` of the ``dlq`` family)."""

    name: str
    run: Action
    summary: str
    """Its one line in ``worker --help``."""
    description: str
    """What its own ``--help`` says first."""
    reads: tuple[Group, ...] = ()
    """The groups of settings it reads besides ``EVERY_COMMAND``, hence takes as flags.

    RETRIES goes with inbox_retention (gc, dlq replay) as well as with the retry queues' names
    (status, verify, demo's topology): Settings refuses a retention shorter than the retry chain,
    so a command that takes one of the two must take the other. LIMITS is read by both ways a
    message comes in, the consumer and the ingress, so the ingress accepts no body the consumer
    would park."""
    options: Options = no_options
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Shorter spellings of a setting's flag that this command takes too, by setting:
    ``worker serve --port 8000`` is ``--ingress-port 8000``."""

    @property
    def groups(self) -> tuple[Group, ...]:
        """Every group of settings it reads."""
        return (*EVERY_COMMAND, *self.reads)


@dataclass(frozen=True)
class Family:
    """A command of commands (``dlq``, ``outbox``): its ACTION names one of them."""

    name: str
    summary: str
    description: str
    commands: tuple[Command, ...]


def import_extra(module: str, *, command: str, extra: str, packages: frozenset[str]) -> ModuleType:
    """``module``, whose command needs an optional extra: when one of the extra's ``packages``
    (their top-level modules) is missing, a ``ConfigurationError`` that says which extra to
    install; any other missing module is raised as it is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in packages:
            raise
        raise ConfigurationError(
            f"worker {command} needs the {extra} extra ({exc.name} is not installed): "
            f"pip install 'rabbit-outbox-worker[{extra}]'"
        ) from exc
