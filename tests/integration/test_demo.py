"""``worker demo``: the traffic is the handler module's own (its ``demo`` hook), the payments
example's by default, and handler modules are found in the current directory."""

from __future__ import annotations

import importlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aio_pika.abc import AbstractRobustConnection

from examples.payments.demo import demo as payments_demo
from examples.payments.demo import plan_payments
from tests.helpers import WORKER_SCRIPT, _environ, worker_environ
from worker.errors import ConfigurationError
from worker.ops.demo import load_demos
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def worker_demo(*argv: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(WORKER_SCRIPT), "demo", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_environ(**env),
        timeout=60,
        check=False,
    )


@pytest.fixture
def module_in(tmp_path: Path) -> Iterator[str]:
    """The name of a handler module that exists only as a file in ``tmp_path`` (no router is
    needed for a demo); its demo prints what it was asked for and publishes nothing."""
    name = f"demo_mod_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(
        "async def demo(settings, options):\n"
        "    return [f'{options.count} from {__name__}']\n"
        "\n"
        "def not_async(settings, options):\n"
        "    return []\n"
    )
    yield name
    sys.modules.pop(name, None)


def test_without_named_modules_the_payments_example_is_the_demo() -> None:
    assert load_demos([], include_installed=False) == [payments_demo]
    assert load_demos(["examples.payments:router"], include_installed=False) == [payments_demo]


def test_handler_modules_without_a_demo_are_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"no demo traffic: none of examples\.orders"):
        load_demos(["examples.orders"], include_installed=False)


def test_a_demo_that_is_not_an_async_function_is_refused(
    module_in: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    module = importlib.import_module(module_in)
    monkeypatch.setattr(module, "demo", module.not_async)

    with pytest.raises(ConfigurationError, match="`demo` must be an async function"):
        load_demos([module_in], include_installed=False)


def test_the_worker_command_imports_handler_modules_from_the_current_directory(
    module_in: str, tmp_path: Path
) -> None:
    # Given a handler module that is a file in the current directory, on no sys.path entry
    # When the installed `worker` script runs its demo (the script's sys.path starts at its bin)
    result = worker_demo("--count", "7", cwd=tmp_path, WORKER_HANDLERS=module_in)

    # Then it was found there, as `python -m` would find it
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"7 from {module_in}"]


@pytest.mark.parametrize("handlers", ["", "examples.payments"])
async def test_worker_demo_publishes_the_payment_requests_from_the_repository_root(
    settings: Settings, amqp: AbstractRobustConnection, handlers: str
) -> None:
    # When `worker demo` runs from the repository root, with the payments example named or not
    result = worker_demo(
        "--count",
        "12",
        "--duplicates",
        "0.25",
        cwd=ROOT,
        **worker_environ(settings, WORKER_HANDLERS=handlers),
    )

    # Then every request, duplicates included, waits in the work queue, and it says so
    assert result.returncode == 0, result.stderr
    plan = plan_payments(12, 0.25, 5, 1)
    assert result.stdout.splitlines()[0] == (
        "published 12 payment requests: 9 unique payments, 3 duplicates"
    )
    assert len(result.stdout.splitlines()) == 1 + len(plan.expected_balances)
    async with amqp.channel() as channel:
        queue = await channel.declare_queue(settings.queue, passive=True)
        assert queue.declaration_result.message_count == 12
