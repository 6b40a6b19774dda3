"""The code map (``docs/internals.md``, "Code map") matches the tree: every module of ``worker/``
is named there, and every path it names exists, so a newcomer's first map of the code is never out
of date."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "worker"


PAGE = ROOT / "docs" / "internals.md"


def _code_map() -> str:
    page = PAGE.read_text()
    start = page.index("## Code map")
    end = page.find("\n## ", start + 1)
    return page[start:] if end == -1 else page[start:end]


def _modules() -> set[str]:
    """Every module of the package but ``__init__``/``__main__`` and the migrations' versions."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name not in {"__init__.py", "__main__.py"} and "migrations" not in path.parts
    }


def test_every_module_is_in_the_code_map() -> None:
    named = set(re.findall(r"`(worker/[\w/]+\.py)`", _code_map()))
    missing = sorted(_modules() - named)
    assert not missing, f"add these modules to the code map in {PAGE.name}: {missing}"


def test_every_path_in_the_code_map_exists() -> None:
    paths = re.findall(r"`((?:worker|examples|benchmarks|tests|docs)/[\w/.]*)`", _code_map())
    assert paths
    gone = sorted(p for p in paths if not (ROOT / p).exists())
    assert not gone, f"the code map in {PAGE.name} names paths that do not exist: {gone}"
