"""The documentation site (``mkdocs.yml``, ``docs/``) builds with ``--strict``: a broken link or
anchor, a page missing from the nav, a file the getting-started page includes that is gone, or a
generated section whose marker was removed fails the test command, not a reader.

The build runs offline with the venv's MkDocs (the test extra) into a temporary directory. Its
generated sections (``docs/hooks.py``) come from the code: the settings table from
``worker.ops.cli.settings_table()``, the commands from the argparse parser, the payments
example's AsyncAPI document from ``worker.ops.asyncapi.document``.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.ops.cli import READS, build_parser
from worker.settings import FIELDS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
INVENTORY = DOCS / "getting-started" / "inventory"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built by ``mkdocs build --strict``; fails on any warning."""
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,  # the snippets' base_path is relative to the repository's root
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner, not a warning
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = built.stdout + built.stderr
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert "WARNING" not in output, output
    return out


def page(site: Path, name: str) -> str:
    """The text of a built page, tags stripped and entities decoded."""
    text = (site / name / "index.html").read_text()
    return html.unescape(re.sub(r"<[^>]+>", "", text))


def test_the_site_builds_strictly(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "search" / "search_index.json").is_file()


def test_the_configuration_page_shows_every_setting(site: Path) -> None:
    source = (DOCS / "configuration.md").read_text()
    assert source.count("<!-- generated: settings -->") == 1
    assert "| `WORKER_" not in source, "the settings table is generated: keep only its marker"
    shown = page(site, "configuration")
    missing = [spec.env for spec in FIELDS if spec.env not in shown]
    assert not missing, f"settings missing from the built configuration page: {missing}"


def test_the_cli_page_shows_every_command(site: Path) -> None:
    source = (DOCS / "cli.md").read_text()
    for marker in ("<!-- generated: commands -->", "<!-- generated: command-reference -->"):
        assert source.count(marker) == 1, f"the CLI page needs one {marker}"
    shown = page(site, "cli")
    missing = [f"worker {command}" for command in READS if f"worker {command}" not in shown]
    assert not missing, f"commands missing from the built CLI page: {missing}"
    help_of = {  # each command's one-line help, as argparse holds it
        choice.dest: choice.help
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
        for choice in action._choices_actions
    }
    assert help_of["run"]
    assert help_of["run"] in shown
    assert "--dry-run" in shown
    assert "--capture-queue" in shown


def test_the_payments_asyncapi_document_is_shown(site: Path) -> None:
    shown = page(site, "handlers")
    for text in ('"asyncapi": "3.0.0"', '"payment.requested"', '"payment.settled"'):
        assert text in shown


def test_the_getting_started_page_includes_every_file_of_the_tested_package() -> None:
    """The inventory package is built and tested on its own; the page shows its files through
    snippets (the build fails on a missing one), and must show all of them."""
    source = (DOCS / "getting-started.md").read_text()
    included = set(re.findall(r'^--8<-- "([^"]+)"$', source, flags=re.MULTILINE))
    assert included, "the getting-started page includes no file of the inventory package"
    files = {
        path.relative_to(INVENTORY).as_posix()
        for pattern in ("*.py", "*.toml", "*.ini")
        for path in INVENTORY.rglob(pattern)
        if not any(part.startswith(".") or part == "__pycache__" for part in path.parts)
        and path.name != "__init__.py"
    }
    assert files, f"no package at {INVENTORY}"
    assert not files - included, f"files of the package the page leaves out: {files - included}"


def test_each_included_file_is_linked_beside_its_block(site: Path) -> None:
    """Read where MkDocs does not run (a code host, an editor), a block shows only its
    ``--8<--`` line: the file it includes is linked just above it, and the link works on the
    site too (the package's files are copied into it)."""
    source = (DOCS / "getting-started.md").read_text()
    blocks = re.findall(
        r'^(.*)\n\n```\w+ title="([^"]+)"\n--8<-- "([^"]+)"$', source, flags=re.MULTILINE
    )
    assert len(blocks) == source.count("\n--8<-- "), "an include outside a titled block"
    for before, title, included in blocks:
        assert title == included
        assert before == f"[`{included}`](getting-started/inventory/{included}):"
        assert (INVENTORY / included).is_file()
        assert (site / "getting-started" / "inventory" / included).is_file()


def test_every_include_line_of_every_page_is_well_formed() -> None:
    """An include line that a formatter rewrote (``--8 < --"file"``, which is valid Python) is
    no include: the page would show that line instead of the file. A page that includes files
    must be kept from ruff format (``extend-exclude`` in pyproject.toml)."""
    for source in DOCS.glob("*.md"):
        lines = re.findall(r"^ *--8 *<.*$", source.read_text(), flags=re.MULTILINE)
        assert all(line.strip().startswith('--8<-- "') for line in lines), (source, lines)


def test_the_publishing_pages_code_is_the_tested_examples() -> None:
    """``docs/publishing.md`` shows its code inline, readable anywhere; each block titled with a
    file is a verbatim excerpt of that file, which the integration tests run."""
    source = (DOCS / "publishing.md").read_text()
    blocks = re.findall(r'^```python title="([^"]+)"\n(.*?)^```$', source, re.M | re.S)
    assert {title for title, _ in blocks} == {
        "examples/producers/publish_amqp.py",
        "examples/producers/publish_outbox.py",
    }
    for title, code in blocks:
        assert code in (ROOT / title).read_text(), f"{title} no longer holds the page's code"


def test_nothing_is_fetched_from_the_internet(site: Path) -> None:
    """No web fonts or scripts from elsewhere: the site reads offline, as it builds."""
    for path in site.rglob("*.html"):
        text = path.read_text()
        assert "fonts.googleapis.com" not in text, path
        assert "fonts.gstatic.com" not in text, path
        assert not re.search(r'<script[^>]+src="https?://', text), path


def test_the_readme_links_only_to_files_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((?!https?://|#)([^)#\s]+)(?:#[^)]*)?\)", readme)
    gone = sorted({t for t in targets if not (ROOT / t).exists()})
    assert not gone, f"the README links to files that do not exist: {gone}"


def test_the_testing_page_shows_the_tested_example(site: Path) -> None:
    """The testing page includes the inventory package's test file (a snippet whose ``--8<--``
    line a formatter mangles is shown as that line instead of the file)."""
    example = (INVENTORY / "tests" / "test_handlers.py").read_text()
    first_test = next(line for line in example.splitlines() if line.startswith("async def test_"))
    shown = page(site, "testing")
    assert first_test in shown
    assert "--8" not in shown
