"""Fresh virtualenvs into which a test installs the project as a user would, offline.

``fresh_venv`` makes a virtualenv without pip; it reaches the test environment's dependencies
(and setuptools, to build without isolation) through a ``.pth`` file, whose directories' own
``.pth`` files are not processed, so the editable install of this checkout stays out of it.
``pip_install`` installs into it with the test environment's pip: no index, no build isolation,
never editable. ``copy_tree`` copies sources without their caches, so what is installed is built
from files that hold no trace of this checkout.
"""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path


def run(
    *argv: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: float = 150
) -> subprocess.CompletedProcess[str]:
    """``argv`` run to its end in ``cwd``; its output captured, its exit status not checked."""
    return subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
        check=False,
    )


def copy_tree(source: Path, names: Iterable[str], destination: Path) -> Path:
    """Copy the files and folders ``names`` of ``source`` into ``destination``, caches left out."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (source / name).is_dir():
            shutil.copytree(
                source / name,
                destination / name,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache"),
            )
        else:
            shutil.copy2(source / name, destination / name)
    return destination


def fresh_venv(path: Path) -> Path:
    """A new virtualenv at ``path`` that sees the test environment's packages; its python."""
    created = run(sys.executable, "-m", "venv", "--without-pip", path, cwd=path.parent)
    assert created.returncode == 0, created.stderr
    python = path / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=path)
    assert purelib.returncode == 0, purelib.stderr
    dependencies = {sysconfig.get_path("purelib"), *site.getsitepackages()}
    (Path(purelib.stdout.strip()) / "test-dependencies.pth").write_text(
        "\n".join(sorted(dependencies)) + "\n"
    )
    return python


def pip_install(python: Path, *projects: Path) -> None:
    """``pip install projects`` (source folders, not editable) into ``python``'s virtualenv,
    offline; their dependencies must already be in the test environment."""
    result = run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        *projects,
        cwd=python.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr
