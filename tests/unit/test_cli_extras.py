"""A command whose optional extra is not installed says which extra to install, and exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

# (a module set to None in sys.modules cannot be imported: as if its package were missing)
SCRIPT = """
import sys
sys.modules[{module!r}] = None
for name in [name for name in sys.modules if name.startswith({package!r})]:
    del sys.modules[name]
from worker.ops.cli import main
sys.exit(main([{command!r}]))
"""


@pytest.mark.parametrize(
    ("command", "module", "package", "extra"),
    [
        ("console", "jinja2", "worker.console", "console"),
        ("serve", "fastapi", "worker.ingress", "http"),
    ],
)
def test_a_command_without_its_extra_names_the_extra(
    command: str, module: str, package: str, extra: str
) -> None:
    # When the command runs where its extra's package is missing
    script = SCRIPT.format(module=module, package=package, command=command)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={"WORKER_HANDLERS": "examples.payments", "PATH": ""},
        check=False,
    )

    # Then it exits 2 and names the extra to install
    assert done.returncode == 2, done.stderr
    assert f"pip install 'rabbit-outbox-worker[{extra}]'" in done.stderr
    assert "Traceback" not in done.stderr
