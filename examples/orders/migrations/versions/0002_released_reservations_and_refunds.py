"""a reservation's release time, a refund's id in the fake gateway's calls

Revision ID: orders_0002
Revises: orders_0001
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "orders_0002"
down_revision: str | None = "orders_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("reservations", sa.Column("released_at", sa.DateTime(timezone=True)))
    op.add_column("gateway_calls", sa.Column("refund_id", sa.Text()))


def downgrade() -> None:
    op.drop_column("gateway_calls", "refund_id")
    op.drop_column("reservations", "released_at")
