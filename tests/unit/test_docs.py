"""The documentation site (``mkdocs.yml``, ``docs/``) builds with ``--strict``: a broken link or
anchor, a page missing from the nav, a file a page includes that is gone, or a generated section
whose marker was removed fails the test command, not a reader.

The build runs offline with the venv's MkDocs (the test extra) into a temporary directory, from
another directory than the repository's. Its generated sections (``docs/generate.py``) come from
the code: the settings table from ``worker.ops.cli.settings_table()``, the commands from the
argparse parser, the payments example's AsyncAPI document from ``worker.ops.asyncapi.document``,
the getting-started package's files from the files; the Markdown holds them too, and a test
fails when what it holds differs from what the code generates now.
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

from docs import generate
from worker.ops.cli import READS, build_parser
from worker.settings import FIELDS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
INVENTORY = DOCS / "getting-started" / "inventory"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built by ``mkdocs build --strict``, from elsewhere than the repository's root
    (nothing in the build depends on the directory it runs in); fails on any warning."""
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [
            *(sys.executable, "-m", "mkdocs", "build", "--strict"),
            *("--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)),
        ],
        cwd=tmp_path_factory.mktemp("elsewhere"),
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


def test_every_generated_section_in_the_markdown_is_what_the_code_generates_now() -> None:
    """What a page holds between its markers is what ``scripts/docs --write`` would write from
    the code as it is: a new command, setting or option, or an edit to an included file, fails
    here until the pages are regenerated."""
    stale = sorted(str(path.relative_to(ROOT)) for path in generate.stale())
    assert not stale, (
        f"generated sections differ from the code in {stale}: run scripts/docs --write"
    )


def test_a_stale_section_is_rewritten_and_an_unknown_one_refused() -> None:
    page_text = (
        "before\n<!-- generated: commands -->\nSTALE\n<!-- end generated: commands -->\nafter\n"
    )
    used: set[str] = set()
    rendered = generate.render(page_text, "page", used)
    assert used == {"commands"}
    assert "STALE" not in rendered
    assert "| [`worker run`](#worker-run) |" in rendered
    assert rendered.startswith("before\n")
    assert rendered.endswith("after\n")
    assert generate.render(rendered) == rendered
    for broken in (
        "<!-- generated: nothing-of-that-name -->\n<!-- end generated: nothing-of-that-name -->",
        "<!-- generated: commands -->\nno end marker",
        "<!-- generated: file docs/gone.py -->\n<!-- end generated: file docs/gone.py -->",
    ):
        with pytest.raises(generate.GenerationError):
            generate.render(broken)


@pytest.mark.parametrize("marker", ["settings", "commands", "command-reference"])
def test_each_generated_section_has_one_place(marker: str) -> None:
    pages = {"settings": "configuration.md"}
    source = (DOCS / pages.get(marker, "cli.md")).read_text()
    assert source.count(f"<!-- generated: {marker} -->") == 1
    assert source.count(f"<!-- end generated: {marker} -->") == 1


def test_the_configuration_page_shows_every_setting(site: Path) -> None:
    source = (DOCS / "configuration.md").read_text()
    shown = page(site, "configuration")
    for where, text in (("built", shown), ("Markdown", source)):
        missing = [spec.env for spec in FIELDS if spec.env not in text]
        assert not missing, f"settings missing from the {where} configuration page: {missing}"


def test_the_cli_page_shows_every_command(site: Path) -> None:
    source = (DOCS / "cli.md").read_text()
    shown = page(site, "cli")
    for where, text in (("built", shown), ("Markdown", source)):
        missing = [f"worker {command}" for command in READS if f"worker {command}" not in text]
        assert not missing, f"commands missing from the {where} CLI page: {missing}"
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


INCLUDED = re.compile(
    r"^<!-- generated: file docs/getting-started/inventory/(\S+) as (\S+) -->$", re.MULTILINE
)


def test_the_getting_started_page_includes_every_file_of_the_tested_package() -> None:
    """The inventory package is built and tested on its own; the page shows its files as they
    are (generated sections), and must show all of them."""
    source = (DOCS / "getting-started.md").read_text()
    included = {path for path, _ in INCLUDED.findall(source)}
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
    """Each file the page shows is linked just above its block, to copy it whole, and the link
    works on the site too (the package's files are copied into it)."""
    source = (DOCS / "getting-started.md").read_text()
    blocks = re.findall(
        r"^(.*)\n\n<!-- generated: file docs/getting-started/inventory/(\S+) as (\S+) -->$",
        source,
        flags=re.MULTILINE,
    )
    assert len(blocks) == len(INCLUDED.findall(source)), "an included file with no link above it"
    for before, included, title in blocks:
        assert title == included
        assert before == f"[`{included}`](getting-started/inventory/{included}):"
        assert (INVENTORY / included).is_file()
        assert (site / "getting-started" / "inventory" / included).is_file()


def test_no_page_shows_an_include_line_instead_of_code() -> None:
    """A page shows code itself, readable where MkDocs does not run (a code host, an editor):
    no pymdown snippet line (``--8<--``), which only the site's build would replace."""
    for source in generate.pages():
        lines = re.findall(r"^ *--8 *<.*$", source.read_text(), flags=re.MULTILINE)
        assert not lines, (source, lines)


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
    """The testing page shows the inventory package's test file, in its Markdown and on the
    site."""
    example = (INVENTORY / "tests" / "test_handlers.py").read_text()
    first_test = next(line for line in example.splitlines() if line.startswith("async def test_"))
    assert example.rstrip() in (DOCS / "testing.md").read_text()
    shown = page(site, "testing")
    assert first_test in shown
    assert "--8" not in shown


def test_the_api_reference_is_generated_from_the_code(site: Path) -> None:
    """The Python API page documents what handler modules, producers and tests import, each
    with its docstring's first line and its methods, from the source it was built from."""
    import worker
    from worker import outbox, testing

    shown = page(site, "api")
    objects = [
        worker.Router,
        worker.Context,
        worker.Workflow,
        worker.Settings,
        testing.Harness,
        outbox.publish,
        worker.Permanent,
    ]
    for documented in objects:
        first_line = (documented.__doc__ or "").strip().splitlines()[0].replace("``", "")
        assert documented.__name__ in shown
        assert first_line in shown, f"{documented.__name__}'s docstring is not on the API page"
    for method in ("handler", "workflow", "batch_handler", "deliver", "deliver_batch", "wait_for"):
        assert method in shown
    assert "ordering_key" in shown  # outbox.publish's signature
