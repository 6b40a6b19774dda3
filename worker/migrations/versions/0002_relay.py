"""relay: last error, ordering index, parked rows

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22

The relay records why a row failed, finds the head row of each ordering key through an index,
and moves rows it gave up on to outbox_parked.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "outbox_parked",
        sa.Column(
            "id", sa.BigInteger(), autoincrement=False, nullable=False, comment="the outbox id"
        ),
        sa.Column("message_id", sa.Uuid(), nullable=False),
        sa.Column("exchange", sa.Text(), nullable=False),
        sa.Column("routing_key", sa.Text(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("content_type", sa.Text(), nullable=False),
        sa.Column("headers", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("correlation_id", sa.Text(), nullable=True),
        sa.Column("causation_id", sa.Text(), nullable=True),
        sa.Column("ordering_key", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "parked_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_parked")),
        sa.UniqueConstraint("message_id", name=op.f("uq_outbox_parked_message_id")),
    )
    op.add_column("outbox", sa.Column("last_error", sa.Text(), nullable=True))
    op.create_index(
        op.f("ix_outbox_ordering_key_id"),
        "outbox",
        ["ordering_key", "id"],
        unique=False,
        postgresql_where=sa.text("ordering_key IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        op.f("ix_outbox_ordering_key_id"),
        table_name="outbox",
        postgresql_where=sa.text("ordering_key IS NOT NULL"),
    )
    op.drop_column("outbox", "last_error")
    op.drop_table("outbox_parked")
