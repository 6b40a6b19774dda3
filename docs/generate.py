"""The parts of the pages generated from the code, written into the Markdown itself so that a
page reads the same on a code host, in an editor and on the site; ``--check`` fails on one stale.

A generated section sits between two markers, each on a line of its own (indented alike inside
an admonition, the section is indented with them)::

    <!-- generated: NAME -->
    ...
    <!-- end generated: NAME -->

NAME is one of ``GENERATORS`` (the settings table, the commands, the command reference, the
payments example's AsyncAPI document), or ``file PATH`` (``file PATH as TITLE``): the file at
PATH from the repository's root, in a fenced block titled TITLE (PATH by default). Between the
markers nothing is written by hand: ``python docs/generate.py --write`` (``scripts/docs
--write``) rewrites every section from the code, ``--check`` lists the pages whose sections
differ from it. An unknown name or a missing file fails both, and the site's build
(``docs/hooks.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SECTION = re.compile(
    r"^(?P<indent> *)<!-- generated: (?P<name>[^>]+?) -->\n"
    r"(?P<body>.*?)"
    r"^(?P=indent)<!-- end generated: (?P=name) -->$",
    re.MULTILINE | re.DOTALL,
)
OPENING = re.compile(r"^ *<!-- generated: ([^>]+?) -->$", re.MULTILINE)
FILE = re.compile(r"^file (?P<path>\S+)(?: as (?P<title>\S+))?$")
LANGUAGES = {".py": "python", ".toml": "toml", ".ini": "ini", ".sh": "sh", ".yml": "yaml"}


class GenerationError(Exception):
    """A page asks for a section nobody can generate."""


def _with_root_on_path() -> None:
    # `examples` is not installed: it is imported from the checkout, as `worker` commands do.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


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
        groups = [group for group in READS.get(command, ()) if group not in EVERY_COMMAND]
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


def included_file(path: str, title: str | None) -> str:
    """The file at ``path`` (from the repository's root) as a fenced block titled ``title``."""
    source = ROOT / path
    if not source.is_file():
        raise GenerationError(f"<!-- generated: file {path} -->: {source} does not exist")
    text = source.read_text()
    fence = "````" if "```" in text else "```"
    language = LANGUAGES.get(source.suffix, "text")
    return f'{fence}{language} title="{title or path}"\n{text.rstrip()}\n{fence}\n'


def section(name: str) -> str:
    """The text of the generated section ``name`` (see the module's docstring)."""
    if (found := FILE.match(name)) is not None:
        return included_file(found["path"], found["title"])
    if name not in GENERATORS:
        raise GenerationError(
            f"unknown section <!-- generated: {name} -->; known: {', '.join(GENERATORS)}, "
            "file PATH [as TITLE]"
        )
    _with_root_on_path()
    return GENERATORS[name]()


def render(markdown: str, where: str = "page", used: set[str] | None = None) -> str:
    """``markdown`` with each generated section rewritten from the code; the names it holds
    are added to ``used``."""
    openings = OPENING.findall(markdown)
    sections = SECTION.findall(markdown)
    if len(openings) != len(sections):
        raise GenerationError(f"{where}: a <!-- generated: NAME --> without its end marker")

    def rewrite(match: re.Match[str]) -> str:
        indent, name = match["indent"], match["name"]
        try:
            text = section(name).rstrip("\n")
        except GenerationError as exc:
            raise GenerationError(f"{where}: {exc}") from None
        if used is not None:
            used.add(name)
        body = "\n".join(indent + line if line else line for line in text.split("\n"))
        return f"{indent}<!-- generated: {name} -->\n{body}\n{indent}<!-- end generated: {name} -->"

    return SECTION.sub(rewrite, markdown)


def pages() -> list[Path]:
    """Every page that may hold generated sections: the site's and the README."""
    return [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]


def stale() -> dict[Path, str]:
    """The pages whose generated sections differ from the code, with their current text."""
    found: dict[Path, str] = {}
    for path in pages():
        text = path.read_text()
        current = render(text, str(path.relative_to(ROOT)))
        if current != text:
            found[path] = current
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", action="store_true", help="rewrite the stale sections")
    what.add_argument("--check", action="store_true", help="fail if a section is stale")
    args = parser.parse_args(argv)
    try:
        found = stale()
    except GenerationError as exc:
        print(f"docs: error: {exc}", file=sys.stderr)
        return 2
    for path, text in found.items():
        name = path.relative_to(ROOT)
        if args.write:
            path.write_text(text)
            print(f"rewrote the generated sections of {name}")
        else:
            print(f"{name}: its generated sections are stale (scripts/docs --write)")
    return 1 if found and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
