"""The shop example's own table; its migration in ``migrations/versions`` creates it."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, DateTime, Integer, MetaData, Table, Text, func

metadata = MetaData()

shop_orders = Table(
    "shop_orders",
    metadata,
    Column("order_id", Text, primary_key=True),
    Column("account", Text, nullable=False),
    Column("sku", Text, nullable=False),
    Column("quantity", Integer, nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
