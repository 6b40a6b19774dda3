"""dead letters: the worker's record of each copy it parked

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25

One row per copy the worker published to the dead-letter queue, written before the copy: its
``x-worker-parking-id``, the handler, key, reason and routing key it was parked with, its body's
SHA-256, and whether its key was recorded as failed. ``worker dlq replay`` trusts a copy only if
such a row names it; the janitor deletes rows older than the inbox retention (through the index
on parked_at).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dead_letters",
        sa.Column(
            "parking_id", sa.Uuid(), nullable=False, comment="the copy's x-worker-parking-id"
        ),
        sa.Column("handler", sa.Text(), nullable=True),
        sa.Column(
            "key",
            sa.Text(),
            nullable=True,
            comment="the idempotency key the copy was parked with",
        ),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("routing_key", sa.Text(), nullable=False),
        sa.Column(
            "body_sha256",
            sa.LargeBinary(),
            nullable=False,
            comment="SHA-256 of the copy's body",
        ),
        sa.Column(
            "failed_key",
            sa.Boolean(),
            nullable=False,
            comment="(handler, key) was recorded as failed in the inbox with this parking",
        ),
        sa.Column(
            "parked_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("parking_id", name=op.f("pk_dead_letters")),
    )
    op.create_index(op.f("ix_dead_letters_parked_at"), "dead_letters", ["parked_at"], unique=False)
    op.create_index(
        op.f("ix_dead_letters_handler_key"), "dead_letters", ["handler", "key"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_dead_letters_handler_key"), table_name="dead_letters")
    op.drop_index(op.f("ix_dead_letters_parked_at"), table_name="dead_letters")
    op.drop_table("dead_letters")
