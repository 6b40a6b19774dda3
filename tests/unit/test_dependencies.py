"""The dependency pins: every dependency has an upper bound on its major version, the locks cover
every dependency with hashes and agree with each other, and the image and the test script
install from them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
RUNTIME_LOCK = ROOT / "requirements.lock"
TEST_LOCK = ROOT / "requirements-test.lock"
DOCS_LOCK = ROOT / "requirements-docs.lock"


def name_of(requirement: str) -> str:
    """The normalised project name of a requirement (PEP 503)."""
    found = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert found is not None, requirement
    return re.sub(r"[-_.]+", "-", found.group(0)).lower()


def pins(lock: Path) -> dict[str, str]:
    """name -> pinned version of a lock file; each pin must carry at least one hash."""
    text = lock.read_text()
    found = dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+) \\$", text, re.MULTILINE))
    assert found, f"{lock.name} pins nothing"
    blocks = re.split(r"^(?=[A-Za-z0-9._-]+==)", text, flags=re.MULTILINE)[1:]
    for block in blocks:
        assert "--hash=sha256:" in block, block.splitlines()[0]
    return {name_of(name): version for name, version in found.items()}


RUNTIME = PYPROJECT["dependencies"]
TEST = PYPROJECT["optional-dependencies"]["test"]
DOCS = PYPROJECT["optional-dependencies"]["docs"]


@pytest.mark.parametrize("requirement", [*RUNTIME, *TEST, *DOCS])
def test_each_dependency_is_bounded_below_its_next_major_version(requirement: str) -> None:
    assert ">=" in requirement
    assert ",<" in requirement


def test_the_runtime_lock_pins_every_runtime_dependency() -> None:
    locked = pins(RUNTIME_LOCK)
    assert {name_of(requirement) for requirement in RUNTIME} <= set(locked)


def test_the_test_lock_pins_every_dependency_and_agrees_with_the_runtime_lock() -> None:
    runtime, test = pins(RUNTIME_LOCK), pins(TEST_LOCK)
    assert {name_of(requirement) for requirement in [*RUNTIME, *TEST]} <= set(test)
    assert {name: test[name] for name in runtime} == runtime


def test_the_image_and_the_test_script_install_from_the_locks_with_hashes() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    script = (ROOT / "scripts" / "test").read_text()

    assert "--require-hashes -r requirements.lock" in dockerfile
    assert "--no-deps ." in dockerfile
    assert "--require-hashes -r requirements-test.lock" in script
    assert "--no-deps -e ." in script


def test_the_test_extra_holds_the_docs_extra_as_it_is() -> None:
    """The test command builds the site (tests/unit/test_docs.py) with what scripts/docs uses."""
    assert set(DOCS) <= set(TEST)


def test_the_docs_lock_pins_the_docs_extra_and_agrees_with_the_test_lock() -> None:
    docs, test = pins(DOCS_LOCK), pins(TEST_LOCK)
    assert {name_of(requirement) for requirement in [*RUNTIME, *DOCS]} <= set(docs)
    assert {name: test[name] for name in docs} == docs


def test_the_docs_script_installs_from_its_lock_with_hashes() -> None:
    script = (ROOT / "scripts" / "docs").read_text()
    assert "--require-hashes -r requirements-docs.lock" in script
    assert "--no-deps -e ." in script
