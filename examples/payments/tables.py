"""The payments example's own tables; its migrations in ``migrations/versions`` create them.

``accounts`` and ``ledger_entries`` are written when a payment settles; ``settlement_notices`` is
the log of notices sent for ``payment.settled`` events, written once per event.
"""

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

settlement_notices = Table(
    "settlement_notices",
    metadata,
    Column("payment_id", Text, primary_key=True),
    Column("event_id", Text, nullable=False, unique=True, comment="message id of the event"),
    Column("account", Text, nullable=False, index=True),
    Column("amount_cents", BigInteger, nullable=False),
    Column("balance_cents", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
