"""Registering handlers on a router, combining routers, and the migrations they own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from worker import Context
from worker.core.router import Router
from worker.errors import ConfigurationError, HandlerRegistrationError


async def _noop(body: Any, ctx: Context) -> None:
    pass


def test_default_name_is_the_routing_key() -> None:
    router = Router()

    @router.handler("order.placed")
    async def place(body: dict[str, Any], ctx: Context) -> None:
        pass

    [handler] = router.handlers()
    assert (handler.name, handler.routing_key, handler.func) == (
        "order.placed",
        "order.placed",
        place,
    )
    assert router.find("order.placed") is handler


def test_name_overrides_the_default() -> None:
    router = Router()
    router.handler("order.placed", name="place-order")(_noop)
    assert router.find("order.placed").name == "place-order"  # type: ignore[union-attr]


def test_the_decorator_returns_the_function_unchanged() -> None:
    assert Router().handler("a")(_noop) is _noop


def test_a_duplicate_routing_key_is_refused() -> None:
    router = Router()
    router.handler("order.placed")(_noop)

    async def other(body: Any, ctx: Context) -> None:
        pass

    with pytest.raises(HandlerRegistrationError, match="already has a handler"):
        router.handler("order.placed", name="other")(other)
    assert router.find("order.placed").func is _noop  # type: ignore[union-attr]


def test_a_duplicate_name_is_refused() -> None:
    router = Router()
    router.handler("order.placed", name="orders")(_noop)
    with pytest.raises(HandlerRegistrationError, match="'orders' is already taken"):
        router.handler("order.cancelled", name="orders")(_noop)
    assert router.routing_keys() == ["order.placed"]


@pytest.mark.parametrize("routing_key", ["order.*", "order.#", "#"])
def test_wildcard_routing_keys_are_refused(routing_key: str) -> None:
    with pytest.raises(HandlerRegistrationError, match="wildcards"):
        Router().handler(routing_key)(_noop)


def test_a_sync_function_is_refused() -> None:
    def sync(body: Any, ctx: Context) -> None:
        pass

    router = Router()
    with pytest.raises(HandlerRegistrationError, match="async def"):
        router.handler("a")(sync)  # type: ignore[arg-type]
    assert router.handlers() == []


def test_a_registration_error_is_a_configuration_error() -> None:
    assert issubclass(HandlerRegistrationError, ConfigurationError)


@pytest.mark.parametrize("arity", [0, 1, 3])
def test_a_wrong_parameter_count_is_refused(arity: int) -> None:
    namespace: dict[str, Any] = {}
    params = ", ".join(f"p{i}" for i in range(arity))
    exec(f"async def handler({params}):\n    pass\n", namespace)
    with pytest.raises(HandlerRegistrationError, match=f"two parameters.*not {arity}"):
        Router().handler("a")(namespace["handler"])


def test_an_unresolvable_annotation_is_refused() -> None:
    async def handler(body: NoSuchType, ctx: Context) -> None:  # type: ignore[name-defined]  # noqa: F821
        pass

    with pytest.raises(HandlerRegistrationError, match="annotations"):
        Router().handler("a")(handler)


def test_routing_keys_are_sorted() -> None:
    router = Router()
    for key in ["c.z", "a.y", "b.x"]:
        router.handler(key)(_noop)
    assert router.routing_keys() == ["a.y", "b.x", "c.z"]


def test_include_serves_the_other_routers_handlers() -> None:
    orders, payments, root = Router(), Router(), Router()
    orders.handler("order.placed")(_noop)
    payments.handler("payment.requested")(_noop)
    root.include(orders)
    root.include(payments)
    assert root.routing_keys() == ["order.placed", "payment.requested"]
    assert root.find("order.placed") is orders.find("order.placed")


def test_include_refuses_a_conflicting_routing_key() -> None:
    a, b = Router(), Router()
    a.handler("order.placed", name="a")(_noop)
    b.handler("order.placed", name="b")(_noop)
    with pytest.raises(HandlerRegistrationError, match="already has a handler"):
        a.include(b)


def test_with_migrations_yields_each_owner_once(tmp_path: Path) -> None:
    # Given a diamond: root includes orders and shared, and orders includes shared too
    shared = Router("shared", migrations=tmp_path / "shared")
    orders = Router("orders", migrations=tmp_path / "orders")
    orders.handler("order.placed")(_noop)
    orders.include(shared)
    plain = Router()
    plain.handler("log.line")(_noop)
    root = Router()
    root.include(orders)
    root.include(shared)
    root.include(plain)

    owners = list(root.with_migrations())

    assert [r.name for r in owners] == ["orders", "shared"]
    assert owners[1] is shared
    assert shared.migrations == tmp_path / "shared"


def test_a_router_with_migrations_yields_itself(tmp_path: Path) -> None:
    router = Router("solo", migrations=str(tmp_path))
    assert list(router.with_migrations()) == [router]
    assert router.migrations == tmp_path


def test_a_router_without_migrations_yields_nothing() -> None:
    assert list(Router("named").with_migrations()) == []


def test_migrations_need_a_name(tmp_path: Path) -> None:
    with pytest.raises(HandlerRegistrationError, match="needs a name"):
        Router(migrations=tmp_path)
