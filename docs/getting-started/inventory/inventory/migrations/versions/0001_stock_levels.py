"""stock levels

Revision ID: inventory_0001
Revises:
Create Date: 2026-11-25

Written by `alembic -n inventory revision --autogenerate --rev-id inventory_0001 -m "stock
levels"`. The inventory's history starts here: it never depends on the worker's revisions.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "inventory_0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stock_levels",
        sa.Column("sku", sa.Text(), nullable=False),
        sa.Column("on_hand", sa.Integer(), nullable=False),
        sa.CheckConstraint("on_hand >= 0", name="stock_levels_on_hand_not_negative"),
        sa.PrimaryKeyConstraint("sku"),
    )


def downgrade() -> None:
    op.drop_table("stock_levels")
