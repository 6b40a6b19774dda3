"""Signals as the router declares them: exactly one place for the correlation, which routing
keys a workflow may wait for, and which correlations are usable (a table, like the policy's)."""

from __future__ import annotations

from typing import Any

import pytest

from worker import Router, Workflow
from worker.core.handler import HandlerKind
from worker.core.signals import InvalidSignal, Signal, correlation_text
from worker.errors import HandlerRegistrationError


def test_a_signal_is_a_plain_handler_of_its_routing_key() -> None:
    # Given a router that declares a signal
    router = Router()
    router.signal("shipping.confirmed", field="order_id", name="confirmations")

    # Then its routing key is served (bound, deduplicated) by a plain handler
    handler = router.find("shipping.confirmed")
    assert handler is not None
    assert (handler.name, handler.kind) == ("confirmations", HandlerKind.PLAIN)
    assert router.declares_signal("shipping.confirmed")
    assert not router.declares_signal("order.placed")


@pytest.mark.parametrize(
    "where", [{}, {"field": "order_id", "header": "x-order-id"}, {"field": ""}]
)
def test_a_signal_names_exactly_one_place_for_its_correlation(where: dict[str, Any]) -> None:
    with pytest.raises(HandlerRegistrationError):
        Router().signal("shipping.confirmed", **where)


def test_a_routing_key_has_one_handler_whether_signal_or_not() -> None:
    router = Router()
    router.signal("shipping.confirmed", header="x-order-id")
    with pytest.raises(HandlerRegistrationError, match="already has a handler"):
        router.signal("shipping.confirmed", field="order_id")


def test_a_workflow_sees_the_signals_of_the_router_it_is_included_in() -> None:
    # Given a workflow in a module's router, and the signal declared by the application's
    orders = Router()

    @orders.workflow("order.placed")
    async def fulfil(body: Any, wf: Workflow) -> None: ...

    app = Router()
    app.signal("shipping.confirmed", field="order_id")
    app.include(orders)

    # Then the workflow's handler knows the signal, and no other routing key as one
    handler = app.find("order.placed")
    assert handler is not None
    assert handler.declares_signal is not None
    assert handler.declares_signal("shipping.confirmed")
    assert not handler.declares_signal("shipping.cancelled")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("o-1", "o-1"),
        (7, "7"),
        (-7, "-7"),
        ("x" * 512, "x" * 512),
        (True, None),
        (None, None),
        (1.5, None),
        (["o-1"], None),
        ({"id": "o-1"}, None),
        ("", None),
        ("a\x00b", None),
        ("x" * 513, None),
    ],
)
def test_a_correlation_is_a_short_string_or_an_integer(value: object, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(InvalidSignal):
            correlation_text(value)
    else:
        assert correlation_text(value) == expected


@pytest.mark.parametrize(
    ("signal", "body", "headers", "expected"),
    [
        (Signal("s", field="order_id"), {"order_id": "o-1"}, {}, "o-1"),
        (Signal("s", field="order_id"), {"order_id": 12}, {"order_id": "h"}, "12"),
        (Signal("s", field="order_id"), {"id": "o-1"}, {}, None),
        (Signal("s", field="order_id"), ["o-1"], {}, None),
        (Signal("s", header="x-order-id"), {}, {"x-order-id": "o-2"}, "o-2"),
        (Signal("s", header="x-order-id"), {}, {"x-order-id": b"o-3"}, "o-3"),
        (Signal("s", header="x-order-id"), {"x-order-id": "o-4"}, {}, None),
    ],
)
def test_a_signal_reads_its_correlation_where_it_was_declared(
    signal: Signal, body: Any, headers: dict[str, Any], expected: str | None
) -> None:
    if expected is None:
        with pytest.raises(InvalidSignal):
            signal.correlation(body, headers)
    else:
        assert signal.correlation(body, headers) == expected
