"""MkDocs hooks (``hooks:`` in ``mkdocs.yml``): the parts of the site generated from the code at
build time, so that they cannot drift from it.

A page asks for one with a marker on a line of its own, ``<!-- generated: NAME -->`` (indented
inside an admonition: the section is indented alike):

- ``settings``: the settings table, ``worker.ops.cli.settings_table()`` (from the settings'
  one declaration in ``worker/settings.py`` and each command's declaration in ``worker/ops/cli/``);
- ``commands``: every command of ``worker`` with its one-line help, from the argparse parser
  (``worker.ops.cli.build_parser()``);
- ``command-reference``: each command's usage, description and own options, from the same
  parser;
- ``asyncapi-payments``: the AsyncAPI document of the payments example, as ``worker asyncapi
  --handlers examples.payments`` prints it.

An unknown marker fails the build, and so does a generator that no page asked for: deleting a
marker cannot silently drop a generated section. So does a page that includes (``--8<--``) a file
that is not there, naming it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^( *)<!-- generated: ([\w-]+) -->$", re.MULTILINE)


def settings() -> str:
    from worker.ops.cli import settings_table

    return settings_table()


def _commands(
    parser: argparse.ArgumentParser, prefix: str = "worker"
) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """Every leaf command under ``parser``: its full name, its one-line help, its parser."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, sub in action.choices.items():
            full = f"{prefix} {name}"
            if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                yield from _commands(sub, full)
            else:
                yield full, helps[name], sub


def _parser() -> argparse.ArgumentParser:
    from worker.ops.cli import build_parser

    return build_parser()


def _anchor(command: str) -> str:
    return command.replace(" ", "-")


def commands() -> str:
    rows = ["| command | what it does |", "|---|---|"]
    for name, summary, _ in _commands(_parser()):
        rows.append(f"| [`{name}`](#{_anchor(name)}) | {summary} |")
    return "\n".join(rows) + "\n"


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage line at a fixed width, whatever the terminal the build runs in."""
    formatter = parser.formatter_class(prog=parser.prog, width=96)  # type: ignore[call-arg]
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _option(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        return " / ".join(f"`{flag}`" for flag in action.option_strings)
    metavar = action.metavar or action.dest.upper()
    return " / ".join(f"`{flag} {metavar}`" for flag in action.option_strings)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def command_reference() -> str:
    from worker.ops.cli import EVERY_COMMAND, READS
    from worker.settings import FIELDS

    setting_names = {spec.name for spec in FIELDS}
    parts: list[str] = []
    for name, summary, sub in _commands(_parser()):
        command = name.removeprefix("worker ")
        parts.append(f"### `{name}` {{#{_anchor(name)}}}\n")
        parts.append(f"{summary[:1].upper()}{summary[1:]}.\n")
        parts.append(f"```text\n{_usage(sub)}\n```\n")
        if sub.description and "\n" in sub.description:  # laid out by hand: kept as it is
            parts.append(f"```text\n{sub.description.strip()}\n```\n")
        elif sub.description:
            parts.append(sub.description.strip() + "\n")
        own = [
            action
            for action in sub._actions
            if action.dest not in setting_names
            and action.help != argparse.SUPPRESS
            and not isinstance(action, argparse._HelpAction)
        ]
        if own:
            rows = ["| option | meaning |", "|---|---|"]
            rows += [f"| {_option(a)} | {_cell(a.help or '')} |" for a in own]
            parts.append("\n".join(rows) + "\n")
        groups = [group for group in READS[command] if group not in EVERY_COMMAND]
        flags = [f"`{spec.flags[0]}`" for spec in FIELDS if spec.group in groups]
        parts.append(
            "Settings: the deployment's and the logging's, as every command"
            + (f", and {', '.join(flags)}" if flags else "")
            + " (see [configuration](configuration.md#settings)).\n"
        )
    return "\n".join(parts)


def asyncapi_payments() -> str:
    import examples.payments
    from worker.ops.asyncapi import document
    from worker.settings import Settings

    text = json.dumps(
        document(examples.payments.router, Settings(), title="examples.payments"), indent=2
    )
    return f"```json\n{text}\n```\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "settings": settings,
    "commands": commands,
    "command-reference": command_reference,
    "asyncapi-payments": asyncapi_payments,
}
_used: set[str] = set()


def on_config(config: MkDocsConfig) -> None:
    # `examples` is not installed: it is imported from the checkout, as `worker` commands do.
    # (MkDocs restores sys.path after loading this module, hence here.)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def on_pre_build(config: MkDocsConfig) -> None:
    _used.clear()


SNIPPET = re.compile(r'^ *--8<-- "([^"]+)"$', re.MULTILINE)


def _check_snippets(markdown: str, page: Page, config: MkDocsConfig) -> None:
    """Fail with the file's full path when a page includes one that is not there (pymdownx's own
    error names only the path as written)."""
    bases = config.mdx_configs.get("pymdownx.snippets", {}).get("base_path", ["."])
    for included in SNIPPET.findall(markdown):
        if not any((ROOT / base / included).is_file() for base in bases):
            where = " or ".join(str(Path(base) / included) for base in bases)
            raise PluginError(f"{page.file.src_path} includes {where}, which does not exist")


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    _check_snippets(markdown, page, config)

    def generate(match: re.Match[str]) -> str:
        indent, name = match.groups()
        if name not in GENERATORS:
            raise PluginError(
                f"{page.file.src_path}: unknown marker <!-- generated: {name} -->; "
                f"known: {', '.join(GENERATORS)}"
            )
        _used.add(name)
        text = GENERATORS[name]().rstrip("\n")
        # An indented marker (inside an admonition, say) gets its section indented alike.
        return "\n".join(indent + line if line else line for line in text.split("\n"))

    return MARKER.sub(generate, markdown)


def on_post_build(config: MkDocsConfig) -> None:
    unused = sorted(set(GENERATORS) - _used)
    if unused:
        raise PluginError(
            "no page has the marker of these generated sections: "
            + ", ".join(f"<!-- generated: {name} -->" for name in unused)
        )
