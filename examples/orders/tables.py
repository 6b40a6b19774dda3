"""The orders example's own tables; its migrations in ``migrations/versions`` create them.

``stock`` holds what can still be reserved: a reservation decrements ``available``, which never
goes below zero. ``reservations`` and ``shipments`` hold one row per order, written by the
workflow's reserving and dispatching steps; a reservation's ``released_at`` is set, once, by the
step that gives its stock back when the order is cancelled. ``gateway_calls`` belongs to the fake
payment gateway, not to the workflow: one row per call (not per charge or refund), so a repeated
call with the same idempotency key shows up as a second row carrying the same charge (or refund)
id. A refund's row names the charge it refunds in ``charge_id`` and its own id in ``refund_id``.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Identity,
    Integer,
    MetaData,
    Table,
    Text,
    func,
)

from worker.sql.tables import NAMING_CONVENTION

metadata = MetaData(naming_convention=NAMING_CONVENTION)

stock = Table(
    "stock",
    metadata,
    Column("sku", Text, primary_key=True),
    Column("available", Integer, nullable=False),
    CheckConstraint("available >= 0", name="available_not_negative"),
)

reservations = Table(
    "reservations",
    metadata,
    Column("order_id", Text, primary_key=True),
    Column("sku", Text, nullable=False),
    Column("quantity", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("released_at", DateTime(timezone=True)),
    CheckConstraint("quantity > 0", name="quantity_positive"),
)

shipments = Table(
    "shipments",
    metadata,
    Column("order_id", Text, primary_key=True),
    Column("charge_id", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

gateway_calls = Table(
    "gateway_calls",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("idempotency_key", Text, nullable=False, index=True),
    Column("operation", Text, nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("charge_id", Text, nullable=False),
    Column("refund_id", Text),
    Column("called_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    comment="every call the fake payment gateway received, one row per call",
)
