"""The orders example handler module: ``worker run --handlers examples.orders``."""

from examples.orders.gateway import FakeGateway
from examples.orders.handlers import (
    OrderPlaced,
    add_stock,
    charge_payment,
    dispatch_shipping,
    fulfil_order,
    reserve_inventory,
    router,
)

__all__ = [
    "FakeGateway",
    "OrderPlaced",
    "add_stock",
    "charge_payment",
    "dispatch_shipping",
    "fulfil_order",
    "reserve_inventory",
    "router",
]
