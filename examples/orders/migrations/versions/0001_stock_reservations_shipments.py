"""stock, reservations, shipments and the fake gateway's calls

Revision ID: orders_0001
Revises:
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "orders_0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stock",
        sa.Column("sku", sa.Text(), nullable=False),
        sa.Column("available", sa.Integer(), nullable=False),
        sa.CheckConstraint("available >= 0", name=op.f("ck_stock_available_not_negative")),
        sa.PrimaryKeyConstraint("sku", name=op.f("pk_stock")),
    )
    op.create_table(
        "reservations",
        sa.Column("order_id", sa.Text(), nullable=False),
        sa.Column("sku", sa.Text(), nullable=False),
        sa.Column("quantity", sa.Integer(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint("quantity > 0", name=op.f("ck_reservations_quantity_positive")),
        sa.PrimaryKeyConstraint("order_id", name=op.f("pk_reservations")),
    )
    op.create_table(
        "shipments",
        sa.Column("order_id", sa.Text(), nullable=False),
        sa.Column("charge_id", sa.Text(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("order_id", name=op.f("pk_shipments")),
    )
    op.create_table(
        "gateway_calls",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("operation", sa.Text(), nullable=False),
        sa.Column("amount_cents", sa.BigInteger(), nullable=False),
        sa.Column("charge_id", sa.Text(), nullable=False),
        sa.Column(
            "called_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gateway_calls")),
        comment="every call the fake payment gateway received, one row per call",
    )
    op.create_index(op.f("ix_gateway_calls_idempotency_key"), "gateway_calls", ["idempotency_key"])


def downgrade() -> None:
    op.drop_index(op.f("ix_gateway_calls_idempotency_key"), table_name="gateway_calls")
    op.drop_table("gateway_calls")
    op.drop_table("shipments")
    op.drop_table("reservations")
    op.drop_table("stock")
