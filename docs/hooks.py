"""MkDocs hooks (``hooks:`` in ``mkdocs.yml``): each page's generated sections are rendered from
the code as the site is built (``docs/generate.py``), so the site never shows a stale one.

An unknown section or a missing included file fails the build, and so does a generator that no
page asked for: deleting a marker cannot silently drop a generated section. The Markdown holds
the same text, kept current by ``scripts/docs --write`` and checked by tests/unit/test_docs.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page


def _load_generate() -> ModuleType:
    """``docs/generate.py``, found beside this file wherever MkDocs runs from."""
    path = Path(__file__).resolve().with_name("generate.py")
    spec = importlib.util.spec_from_file_location("docs_generate", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


generate = _load_generate()
_used: set[str] = set()


def on_pre_build(config: MkDocsConfig) -> None:
    _used.clear()


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    try:
        rendered: str = generate.render(markdown, page.file.src_path, _used)
    except generate.GenerationError as exc:
        raise PluginError(str(exc)) from None
    return rendered


def on_post_build(config: MkDocsConfig) -> None:
    unused = sorted(set(generate.GENERATORS) - _used)
    if unused:
        raise PluginError(
            "no page has the marker of these generated sections: "
            + ", ".join(f"<!-- generated: {name} -->" for name in unused)
        )
