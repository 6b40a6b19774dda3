"""workflows: owner and lease on inbox rows, step outputs

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22

A workflow's inbox row stays in_progress between its steps, owned by one delivery under a lease;
each committed step's output is kept in workflow_steps (deleted with its inbox row).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "inbox",
        sa.Column("owner", sa.Text(), nullable=True, comment="the delivery running this workflow"),
    )
    op.add_column("inbox", sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_inbox_in_progress",
        "inbox",
        ["updated_at"],
        postgresql_where=sa.text("status = 'in_progress'"),
    )
    op.create_table(
        "workflow_steps",
        sa.Column("handler", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("step", sa.Text(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("output", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column(
            "completed_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["handler", "key"],
            ["inbox.handler", "inbox.key"],
            name="fk_workflow_steps_handler_inbox",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("handler", "key", "step", name="pk_workflow_steps"),
    )


def downgrade() -> None:
    op.drop_table("workflow_steps")
    op.drop_index("ix_inbox_in_progress", table_name="inbox")
    op.drop_column("inbox", "lease_until")
    op.drop_column("inbox", "owner")
