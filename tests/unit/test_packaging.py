"""What ``pip install .`` installs: the ``worker`` package and command under the distribution
name ``rabbit-outbox-worker``, and nothing else (no top-level ``examples``).

It really builds and installs: the project's sources are copied, installed without build
isolation or an index (offline; setuptools comes from the test environment) into a fresh
virtualenv, and the result is imported from a directory that holds no sources (``tests.venvs``:
the fresh virtualenv reaches the test environment's dependencies through a ``.pth`` file).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from tests.venvs import copy_tree, fresh_venv, pip_install, run

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DIST_NAME = "rabbit-outbox-worker"
SOURCES = ("pyproject.toml", "README.md", "worker", "examples")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh virtualenv into which ``pip install .`` installed the project."""
    base = tmp_path_factory.mktemp("packaging")
    source = copy_tree(ROOT, SOURCES, base / "source")
    python = fresh_venv(base / "venv")
    pip_install(python, source)
    return python


def test_the_distribution_is_named_for_the_package_index() -> None:
    assert PROJECT["name"] == DIST_NAME
    assert PROJECT["scripts"] == {"worker": "worker.ops.cli:main"}


def test_only_the_worker_package_is_installed(installed: Path, tmp_path: Path) -> None:
    # When the installed distribution's files are listed (from a directory without sources)
    listing = run(
        installed,
        "-c",
        "import importlib.metadata as m, json\n"
        f"dist = m.distribution({DIST_NAME!r})\n"
        "print(json.dumps({'version': dist.version, 'name': dist.metadata['Name'],\n"
        "    'files': [str(f) for f in dist.files],\n"
        "    'scripts': [e.value for e in dist.entry_points if e.group == 'console_scripts'],\n"
        "    'pytest11': [e.value for e in dist.entry_points if e.group == 'pytest11']}))",
        cwd=tmp_path,
    )
    assert listing.returncode == 0, listing.stderr
    dist = json.loads(listing.stdout)

    # Then it is this project, its one top-level package is `worker`, with its migrations
    assert (dist["name"], dist["version"]) == (DIST_NAME, PROJECT["version"])
    top_level = {
        Path(file).parts[0]
        for file in dist["files"]
        if not file.startswith("..") and not Path(file).parts[0].endswith(".dist-info")
    }
    assert top_level == {"worker"}
    assert "worker/migrations/versions/0001_inbox_and_outbox.py" in dist["files"]
    assert dist["scripts"] == ["worker.ops.cli:main"]
    assert dist["pytest11"] == ["worker.pytest_plugin"]  # (the fixtures for users' tests)


def test_worker_imports_and_examples_does_not(installed: Path, tmp_path: Path) -> None:
    worker = run(installed, "-c", "import worker; print(worker.__file__)", cwd=tmp_path)
    assert worker.returncode == 0, worker.stderr
    assert Path(worker.stdout.strip()).is_relative_to(installed.parent.parent)

    examples = run(installed, "-c", "import examples", cwd=tmp_path)
    assert examples.returncode == 1
    assert "No module named 'examples'" in examples.stderr

    command = run(installed.with_name("worker"), "demo", "--help", cwd=tmp_path)
    assert command.returncode == 0, command.stderr


def test_handler_modules_load_from_the_repository_root_when_installed(installed: Path) -> None:
    # Given the non-editable install, run from a checkout (-I: Python adds no directory itself)
    loaded = run(
        installed,
        "-I",
        "-c",
        "from worker.ops.plugins import load_routers\n"
        "print(load_routers(['examples.payments'], include_installed=False).routing_keys())",
        cwd=ROOT,
    )

    # Then the handler module named as WORKER_HANDLERS names it is found in the checkout
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "['payment.requested', 'payment.settled']"
