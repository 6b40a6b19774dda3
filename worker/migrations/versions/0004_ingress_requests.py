"""ingress: the requests the HTTP ingress accepted

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25

One row per (handler, idempotency key) accepted by ``worker serve``: the fingerprint of its body
(a retry with another body is refused) and the message id of the event appended with it. The
janitor deletes rows older than the inbox retention, through the index on accepted_at.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "ingress_requests",
        sa.Column(
            "handler",
            sa.Text(),
            nullable=False,
            comment="the handler of the routing key posted to",
        ),
        sa.Column("key", sa.Text(), nullable=False, comment="the client's Idempotency-Key"),
        sa.Column("routing_key", sa.Text(), nullable=False),
        sa.Column(
            "fingerprint",
            sa.LargeBinary(),
            nullable=False,
            comment="SHA-256 of the canonical body",
        ),
        sa.Column(
            "message_id",
            sa.Uuid(),
            nullable=False,
            comment="the event appended to the outbox",
        ),
        sa.Column(
            "accepted_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("handler", "key", name=op.f("pk_ingress_requests")),
    )
    op.create_index(
        op.f("ix_ingress_requests_accepted_at"), "ingress_requests", ["accepted_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_ingress_requests_accepted_at"), table_name="ingress_requests")
    op.drop_table("ingress_requests")
