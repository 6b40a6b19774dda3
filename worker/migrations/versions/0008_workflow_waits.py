"""workflow waits: workflow_waits, workflow_signals

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26

A workflow that waits (for a signal with a timeout, or a sleep) keeps its wait in
``workflow_waits`` (with the message that resumes it and its timer's id) and holds nothing else;
signals that come before anyone waits for them are kept in ``workflow_signals`` until a wait
takes them or the inbox's retention drops them.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _create_workflow_waits()
    _create_workflow_signals()


def _create_workflow_waits() -> None:
    """One row per wait of a workflow; its open ones indexed by correlation and deadline."""
    op.create_table(
        "workflow_waits",
        sa.Column("handler", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column(
            "name",
            sa.Text(),
            nullable=False,
            comment="the wait's name, in the namespace of steps",
        ),
        sa.Column(
            "routing_key",
            sa.Text(),
            nullable=True,
            comment="the signal waited for; NULL: a sleep",
        ),
        sa.Column("correlation", sa.Text(), nullable=True),
        sa.Column(
            "due_at",
            sa.DateTime(timezone=True),
            nullable=False,
            comment="by the database's clock",
        ),
        sa.Column(
            "timer_id",
            sa.Uuid(),
            nullable=True,
            comment="message id of the scheduled resume",
        ),
        sa.Column("resume_exchange", sa.Text(), nullable=False),
        sa.Column("resume_routing_key", sa.Text(), nullable=False),
        sa.Column("resume_body", sa.LargeBinary(), nullable=False),
        sa.Column("resume_content_type", sa.Text(), nullable=False),
        sa.Column("resume_headers", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("resume_correlation_id", sa.Text(), nullable=True),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.Column(
            "event",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=True,
            comment="what resolved it: body and message id",
        ),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "outcome IN ('event', 'timeout')", name=op.f("ck_workflow_waits_outcome")
        ),
        sa.ForeignKeyConstraint(
            ["handler", "key"],
            ["inbox.handler", "inbox.key"],
            name=op.f("fk_workflow_waits_handler_inbox"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("handler", "key", "name", name=op.f("pk_workflow_waits")),
    )
    op.create_index(
        "ix_workflow_waits_open_correlation",
        "workflow_waits",
        ["routing_key", "correlation"],
        unique=False,
        postgresql_where=sa.text("outcome IS NULL"),
    )
    op.create_index(
        "ix_workflow_waits_open_due_at",
        "workflow_waits",
        ["due_at"],
        unique=False,
        postgresql_where=sa.text("outcome IS NULL"),
    )


def _create_workflow_signals() -> None:
    """Signals that came before any wait for them, kept for the wait registered later."""
    op.create_table(
        "workflow_signals",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("routing_key", sa.Text(), nullable=False),
        sa.Column("correlation", sa.Text(), nullable=False),
        sa.Column("message_id", sa.Text(), nullable=True),
        sa.Column("event", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "received_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("consumed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("consumed_by_handler", sa.Text(), nullable=True),
        sa.Column("consumed_by_key", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workflow_signals")),
    )
    op.create_index(
        "ix_workflow_signals_unconsumed",
        "workflow_signals",
        ["routing_key", "correlation", "id"],
        unique=False,
        postgresql_where=sa.text("consumed_at IS NULL"),
    )
    op.create_index(
        op.f("ix_workflow_signals_received_at"),
        "workflow_signals",
        ["received_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_workflow_signals_received_at"), table_name="workflow_signals")
    op.drop_index("ix_workflow_signals_unconsumed", table_name="workflow_signals")
    op.drop_table("workflow_signals")
    op.drop_index("ix_workflow_waits_open_due_at", table_name="workflow_waits")
    op.drop_index("ix_workflow_waits_open_correlation", table_name="workflow_waits")
    op.drop_table("workflow_waits")
