"""The payments example's own tables; its migrations in ``migrations/versions`` create them."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, DateTime, MetaData, Table, Text, func

metadata = MetaData()

accounts = Table(
    "accounts",
    metadata,
    Column("account", Text, primary_key=True),
    Column("balance_cents", BigInteger, nullable=False),
)

ledger_entries = Table(
    "ledger_entries",
    metadata,
    Column("payment_id", Text, primary_key=True),
    Column("account", Text, nullable=False, index=True),
    Column("amount_cents", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
