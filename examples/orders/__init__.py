"""The orders example handler module: ``worker run --handlers examples.orders``."""

from examples.orders.gateway import FakeGateway
from examples.orders.handlers import (
    SHIPPING_TIMEOUT,
    OrderPlaced,
    ShippingConfirmed,
    add_stock,
    cancel_order,
    charge_payment,
    dispatch_shipping,
    fulfil_order,
    refund_payment,
    release_reservation,
    reserve_inventory,
    router,
    shipping_timeout,
)

__all__ = [
    "SHIPPING_TIMEOUT",
    "FakeGateway",
    "OrderPlaced",
    "ShippingConfirmed",
    "add_stock",
    "cancel_order",
    "charge_payment",
    "dispatch_shipping",
    "fulfil_order",
    "refund_payment",
    "release_reservation",
    "reserve_inventory",
    "router",
    "shipping_timeout",
]
