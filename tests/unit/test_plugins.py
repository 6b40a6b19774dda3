"""Finding handler modules by name and through installed ``worker.handlers`` entry points."""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from examples.payments import router as payments_router
from tests.helpers import WORKER_SCRIPT, run
from worker.errors import ConfigurationError
from worker.ops.plugins import installed_targets, load_router_from, load_routers


def test_a_module_name_loads_its_router() -> None:
    router = load_router_from("examples.payments")
    assert router is payments_router
    assert router.name == "payments"
    assert router.routing_keys() == ["payment.requested", "payment.settled"]


def test_module_colon_attribute_loads_that_router() -> None:
    assert load_router_from("examples.payments:router") is payments_router


def test_a_module_without_a_router_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="no Router named 'router'"):
        load_router_from("worker.core.codec")


def test_an_attribute_that_is_not_a_router_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="no Router named 'PaymentRequested'"):
        load_router_from("examples.payments:PaymentRequested")


def test_a_missing_module_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="no_such_module_xyz"):
        load_router_from("no_such_module_xyz")


def test_the_same_router_named_twice_is_included_once() -> None:
    combined = load_routers(
        ["examples.payments", "examples.payments:router"], include_installed=False
    )
    assert combined.routing_keys() == ["payment.requested", "payment.settled"]
    assert list(combined.with_migrations()) == [payments_router]


@dataclass
class Plugin:
    module: str
    routing_key: str


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plugin]:
    """A real distribution on sys.path whose ``worker.handlers`` entry point names a module."""
    suffix = uuid.uuid4().hex[:10]
    module = f"plugin_mod_{suffix}"
    routing_key = f"plugin.{suffix}"
    (tmp_path / f"{module}.py").write_text(
        "from worker import Router\n"
        "\n"
        "router = Router()\n"
        "\n"
        f"@router.handler({routing_key!r})\n"
        "async def handle(body, ctx):\n"
        "    return body\n"
    )
    dist_info = tmp_path / f"worker_plugin_{suffix}-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: worker-plugin-{suffix}\nVersion: 0.1\n"
    )
    (dist_info / "entry_points.txt").write_text(f"[worker.handlers]\nplug = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield Plugin(module, routing_key)
    finally:
        sys.modules.pop(module, None)
        monkeypatch.undo()
        importlib.invalidate_caches()


def test_an_installed_entry_point_is_listed(plugin: Plugin) -> None:
    assert plugin.module in installed_targets()


def test_installed_plugins_are_served(plugin: Plugin) -> None:
    combined = load_routers([])
    handler = combined.find(plugin.routing_key)
    assert handler is not None
    assert handler.func.__module__ == plugin.module


def test_installed_plugins_are_skipped_when_asked(plugin: Plugin) -> None:
    combined = load_routers([], include_installed=False)
    assert combined.find(plugin.routing_key) is None
    assert plugin.module not in sys.modules


def test_named_modules_and_installed_plugins_combine(plugin: Plugin) -> None:
    combined = load_routers(["examples.payments"])
    assert {"payment.requested", plugin.routing_key} <= set(combined.routing_keys())


def test_an_unnamed_plugin_router_is_named_after_its_module(plugin: Plugin) -> None:
    router = load_router_from(plugin.module)
    assert router.name == plugin.module


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--no-installed-handlers"], {}),
        ([], {"WORKER_INSTALLED_HANDLERS": "false"}),
    ],
)
def test_a_deployment_may_serve_only_the_modules_it_names(
    plugin: Plugin, tmp_path: Path, argv: list[str], env: dict[str, str]
) -> None:
    # Given a plugin installed in the environment, and no module named: with installed handlers
    # off there is nothing to serve, so the worker refuses to start instead of serving the plugin
    result = run(WORKER_SCRIPT, "run", *argv, PYTHONPATH=str(tmp_path), WORKER_HANDLERS="", **env)
    assert result.returncode == 2, result.stderr
    assert "no handlers" in result.stderr
