"""console_audit: repeats, last_at

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02

A refusal a session meets again (the same action, the same reason) within a window is counted on
its first entry (``repeats``, ``last_at``) instead of adding a row; the janitor deletes entries
older than ``console_audit_retention`` by the existing index on ``at``.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "console_audit",
        sa.Column(
            "repeats",
            sa.Integer(),
            server_default=sa.text("1"),
            nullable=False,
            comment="how many times it happened: a refusal repeated within a window counts here",
        ),
    )
    op.add_column(
        "console_audit",
        sa.Column(
            "last_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="when it last happened, for an entry repeated",
        ),
    )


def downgrade() -> None:
    op.drop_column("console_audit", "last_at")
    op.drop_column("console_audit", "repeats")
