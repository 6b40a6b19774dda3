"""scheduled events: outbox_scheduled

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26

Events published with ``delay=`` or ``at=`` wait in ``outbox_scheduled`` until the database's
clock says they are due; a relay then moves them into ``outbox`` (earliest first, through the
index on ``(due_at, id)``; an ordering key's events through ``(ordering_key, due_at, id)``) and
publishes them like any other event. Future events never enter ``outbox``, so the relay's claim
does not scan them.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "outbox_scheduled",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("message_id", sa.Uuid(), nullable=False),
        sa.Column("exchange", sa.Text(), nullable=False),
        sa.Column("routing_key", sa.Text(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("content_type", sa.Text(), nullable=False),
        sa.Column(
            "headers",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("correlation_id", sa.Text(), nullable=True),
        sa.Column("causation_id", sa.Text(), nullable=True),
        sa.Column("ordering_key", sa.Text(), nullable=True),
        sa.Column(
            "due_at",
            sa.DateTime(timezone=True),
            nullable=False,
            comment="by the database's clock",
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_scheduled")),
        sa.UniqueConstraint("message_id", name=op.f("uq_outbox_scheduled_message_id")),
    )
    op.create_index(
        op.f("ix_outbox_scheduled_due_at_id"), "outbox_scheduled", ["due_at", "id"], unique=False
    )
    op.create_index(
        op.f("ix_outbox_scheduled_ordering_key_due_at_id"),
        "outbox_scheduled",
        ["ordering_key", "due_at", "id"],
        unique=False,
        postgresql_where=sa.text("ordering_key IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        op.f("ix_outbox_scheduled_ordering_key_due_at_id"),
        table_name="outbox_scheduled",
        postgresql_where=sa.text("ordering_key IS NOT NULL"),
    )
    op.drop_index(op.f("ix_outbox_scheduled_due_at_id"), table_name="outbox_scheduled")
    op.drop_table("outbox_scheduled")
