"""Settings as flags: a command takes as flags only the settings of the groups it reads
(``Command.reads``), each shown once in its ``--help``, and refuses another command's setting flag
naming the commands that read it; a flag wins over its ``WORKER_*`` variable. The settings table of
the documentation comes from the same declarations."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from worker.ops.cli.command import Command
from worker.settings import FIELDS, Field, Group, Settings


def load_settings(args: argparse.Namespace) -> Settings:
    """The settings: each flag given, else its variable, else its default."""
    return Settings.load(**{spec.name: getattr(args, spec.name, None) for spec in FIELDS})


def readers(group: Group, commands: Sequence[Command]) -> list[str]:
    """The ``commands`` that read ``group``'s settings, in their order."""
    return [command.name for command in commands if group in command.groups]


def add_settings(
    parser: argparse.ArgumentParser, command: Command, commands: Sequence[Command]
) -> None:
    """The flags of the settings ``command`` reads, a section per group; the others refused,
    naming which of ``commands`` read them."""
    reads = command.groups
    for group in (group for group in Group if group in reads):
        section = parser.add_argument_group(group.value)
        for spec in (spec for spec in FIELDS if spec.group is group):
            aliases = command.aliases
            _add_flag(section, spec, [aliases[spec.name]] if spec.name in aliases else [])
    for spec in (spec for spec in FIELDS if spec.group not in reads):
        parser.add_argument(
            *spec.flags,
            dest=spec.name,
            action=_Refused,
            refusal=f"is not a setting of {command.name!r} "
            f"(it is read by: {', '.join(readers(spec.group, commands))})",
            help=argparse.SUPPRESS,
        )


def _flag_help(spec: Field) -> str:
    help = f"{spec.help} [{spec.env}; default {spec.shown_default}]"
    return help.replace("%", "%%")


def _add_flag(section: argparse._ArgumentGroup, spec: Field, aliases: Sequence[str] = ()) -> None:
    """``spec``'s flag (``--x`` / ``--no-x`` for a switch) and its ``aliases``; None unless
    given."""
    if spec.switch:
        section.add_argument(
            spec.flag,
            dest=spec.name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=_flag_help(spec),
        )
    else:
        section.add_argument(
            spec.flag,
            *aliases,
            dest=spec.name,
            type=_parser_of(spec),
            default=None,
            metavar=spec.name.upper(),
            help=_flag_help(spec),
        )


def _parser_of(spec: Field) -> Callable[[str], Any]:
    """``spec.parse`` for argparse: its error names the flag's value redacted, or none for a
    secret (argparse's own message would repeat the value as given)."""

    def parse(raw: str) -> Any:
        try:
            return spec.parse(raw)
        except ValueError as exc:
            shown = f"{spec.shown(raw).removeprefix('=')}: " if not spec.secret else ""
            raise argparse.ArgumentTypeError(f"{shown}{exc}") from None

    parse.__name__ = spec.parse.__name__
    return parse


class _Refused(argparse.Action):
    """The flag of a setting the command does not read: a usage error that says who reads it,
    rather than argparse's "unrecognized arguments" (or a prefix match with another flag)."""

    def __init__(self, option_strings: list[str], dest: str, refusal: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, **kwargs)
        self.refusal = refusal

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.print_usage(sys.stderr)
        parser.exit(2, f"worker: error: {option_string} {self.refusal}\n")


def settings_table(commands: Sequence[Command]) -> str:
    """The settings table of the documentation's configuration page: a row per setting, in
    declaration order, with which of ``commands`` take its flag."""
    rows = [
        "| variable | flag | default | flag of | meaning |",
        "|---|---|---|---|---|",
        *(_table_row(spec, commands) for spec in FIELDS),
    ]
    return "\n".join(rows) + "\n"


def _table_row(spec: Field, commands: Sequence[Command]) -> str:
    takers = readers(spec.group, commands)
    aliases = [
        f"`{command.aliases[spec.name]}` (`{command.name}`)"
        for command in commands
        if spec.name in command.aliases
    ]
    cells = (
        f"`{spec.env}`",
        " / ".join([*(f"`{flag}`" for flag in spec.flags), *aliases]),
        f"`{spec.shown_default}`",
        "every command" if len(takers) == len(commands) else ", ".join(f"`{c}`" for c in takers),
        spec.help,
    )
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


_SETTING_NAMES = frozenset(spec.name for spec in FIELDS)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Usage names a command's own options, then ``[--SETTING ...]``: its settings are listed
    once, in their sections below."""

    def _format_usage(
        self,
        usage: str | None,
        actions: Iterable[argparse.Action],
        groups: Iterable[argparse._MutuallyExclusiveGroup],
        prefix: str | None,
    ) -> str:
        actions = list(actions)
        own = [action for action in actions if action.dest not in _SETTING_NAMES]
        text = super()._format_usage(usage, own, groups, prefix)
        if usage is not None or len(own) == len(actions):
            return text
        return text.rstrip("\n") + " [--SETTING ...]\n\n"
