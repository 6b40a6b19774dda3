"""settlement notices

Revision ID: payments_0002
Revises: payments_0001
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "payments_0002"
down_revision: str | None = "payments_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "settlement_notices",
        sa.Column("payment_id", sa.Text(), nullable=False),
        sa.Column("event_id", sa.Text(), nullable=False, comment="message id of the event"),
        sa.Column("account", sa.Text(), nullable=False),
        sa.Column("amount_cents", sa.BigInteger(), nullable=False),
        sa.Column("balance_cents", sa.BigInteger(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("payment_id"),
        sa.UniqueConstraint("event_id"),
    )
    op.create_index(
        op.f("ix_settlement_notices_account"), "settlement_notices", ["account"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_settlement_notices_account"), table_name="settlement_notices")
    op.drop_table("settlement_notices")
