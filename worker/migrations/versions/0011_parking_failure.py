"""dead_letters: error, exception_type, attempts, first_failure_at, replayed_at

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02

The worker's record of a parking keeps the failure it parked the copy for, so that what the
DLQ tools show comes from the record, never from headers anyone who can dead-letter a copy
chose. Rows recorded before have none (NULL): they are shown as not recorded. ``replayed_at``
marks a parking whose copy was replayed, so that another copy of it is never taken for the
worker's own. Adding nullable
columns without a default rewrites nothing and locks the table only for the catalog change.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("error", sa.Text(), "the failure the copy was parked for, as the worker wrote it"),
    ("exception_type", sa.Text(), "the type of the exception that failed it"),
    ("attempts", sa.Integer(), "failed deliveries of the message, this one included"),
    ("first_failure_at", sa.Text(), "when its first delivery failed (ISO 8601)"),
    ("replayed_at", sa.DateTime(timezone=True), "when its copy was replayed, if it was"),
)


def upgrade() -> None:
    for name, type_, comment in COLUMNS:
        op.add_column("dead_letters", sa.Column(name, type_, nullable=True, comment=comment))


def downgrade() -> None:
    for name, _, _ in reversed(COLUMNS):
        op.drop_column("dead_letters", name)
