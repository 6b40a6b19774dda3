"""Every command of ``worker``, collected from the command modules, and what derives from their
declarations: the argparse parser (with each command's ``--help``), which groups of settings each
command reads (``READS``) and the documentation's settings table."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from worker.ops.cli import console, demo, dlq, outbox, run, schema, status
from worker.ops.cli.command import Command, Family
from worker.ops.cli.flags import HelpFormatter, add_settings
from worker.ops.cli.flags import settings_table as _settings_table
from worker.settings import Group

COMMANDS: tuple[Command | Family, ...] = (
    *run.COMMANDS,
    dlq.DLQ,
    status.STATUS,
    outbox.OUTBOX,
    status.VERIFY,
    status.HEALTH,
    console.CONSOLE,
    *schema.COMMANDS,
    demo.DEMO,
)
"""The commands in the order ``worker --help`` lists them."""

LEAVES: tuple[Command, ...] = tuple(
    command
    for entry in COMMANDS
    for command in (entry.commands if isinstance(entry, Family) else (entry,))
)
"""Every command that runs something (``dlq list``, not ``dlq``), in the same order."""

READS: Mapping[str, tuple[Group, ...]] = {command.name: command.groups for command in LEAVES}
"""Each command and the groups of settings it reads, hence takes as flags (``Command.reads``)."""


def settings_table() -> str:
    """The settings table of the documentation's configuration page (inserted by ``docs/hooks.py``
    when the site is built): a row per setting, in declaration order, with the commands that take
    its flag."""
    return _settings_table(LEAVES)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="worker",
        description=(
            "An asyncio RabbitMQ worker: each message's effect is committed exactly once in "
            "PostgreSQL together with the events it emits (transactional outbox); the message "
            "is acked only after that commit."
        ),
        epilog=(
            "Each command's --help lists the settings it reads, as flags. Every setting is also "
            "a WORKER_* environment variable, which every command reads; a flag wins over it."
        ),
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for entry in COMMANDS:
        if isinstance(entry, Family):
            family = commands.add_parser(
                entry.name, help=entry.summary, description=entry.description
            )
            actions = family.add_subparsers(
                dest=f"{entry.name}_command", required=True, metavar="ACTION"
            )
            for command in entry.commands:
                _add_command(actions, command, LEAVES)
        else:
            _add_command(commands, entry, LEAVES)
    return parser


def _add_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    command: Command,
    every: Sequence[Command],
) -> None:
    """The subcommand for ``command`` (``dlq list``: ``list`` of ``dlq``), which takes the
    settings it reads as flags, then its own, and runs ``command.run``."""
    sub = commands.add_parser(
        command.name.split()[-1],
        help=command.summary,
        description=command.description,
        formatter_class=HelpFormatter,
    )
    add_settings(sub, command, every)
    command.options(sub)
    sub.set_defaults(func=command.run)
