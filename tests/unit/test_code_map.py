"""The README's code map matches the tree: every module of ``worker/`` is named there, and every
path it names exists, so a newcomer's first map of the code is never out of date."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "worker"


def _code_map() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Code map")
    end = readme.index("\n## ", start + 1)
    return readme[start:end]


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
    assert not missing, f"add these modules to the README's code map: {missing}"


def test_every_path_in_the_code_map_exists() -> None:
    paths = re.findall(r"`((?:worker|examples|benchmarks|tests)/[\w/.]*)`", _code_map())
    assert paths
    gone = sorted(p for p in paths if not (ROOT / p).exists())
    assert not gone, f"the README's code map names paths that do not exist: {gone}"
