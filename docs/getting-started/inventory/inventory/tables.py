"""The inventory's own tables. Its migrations (``migrations/versions``) create them, beside the
worker's ``inbox`` and ``outbox`` in the same database, under a history of their own."""

from sqlalchemy import CheckConstraint, Column, Integer, MetaData, Table, Text

metadata = MetaData()

stock_levels = Table(
    "stock_levels",
    metadata,
    Column("sku", Text, primary_key=True),
    Column("on_hand", Integer, nullable=False),
    # The database itself refuses a negative stock level, whatever the code does.
    CheckConstraint("on_hand >= 0", name="stock_levels_on_hand_not_negative"),
)
