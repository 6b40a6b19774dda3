"""accounts and ledger_entries

Revision ID: payments_0001
Revises:
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "payments_0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("account", sa.Text(), nullable=False),
        sa.Column("balance_cents", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("account"),
    )
    op.create_table(
        "ledger_entries",
        sa.Column("payment_id", sa.Text(), nullable=False),
        sa.Column("account", sa.Text(), nullable=False),
        sa.Column("amount_cents", sa.BigInteger(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("payment_id"),
    )
    op.create_index("ix_ledger_entries_account", "ledger_entries", ["account"])


def downgrade() -> None:
    op.drop_index("ix_ledger_entries_account", table_name="ledger_entries")
    op.drop_table("ledger_entries")
    op.drop_table("accounts")
