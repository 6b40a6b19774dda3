"""console: process_samples, console_audit

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26

Every worker and relay process writes a sample of itself to ``process_samples`` every few seconds
(kept for a bounded time): ``worker status`` and the console read every process's state and
rates from it. ``console_audit`` records each action taken in the console.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _create_process_samples()
    _create_console_audit()


def _create_process_samples() -> None:
    """One row per sample of a running process, by time and by process."""
    op.create_table(
        "process_samples",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column(
            "process",
            sa.Text(),
            nullable=False,
            comment="host:pid:start, unique per process run",
        ),
        sa.Column("role", sa.Text(), nullable=False, comment="worker or relay"),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "sampled_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "state",
            sa.Text(),
            nullable=False,
            comment="consuming, paused, throttled, draining, ...",
        ),
        sa.Column("reason", sa.Text(), nullable=True, comment="why it is paused, when it is"),
        sa.Column(
            "counters",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            comment="its counters since it started",
        ),
        sa.Column(
            "gauges",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            comment="the backlogs it saw",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_process_samples")),
    )
    op.create_index(
        op.f("ix_process_samples_sampled_at"), "process_samples", ["sampled_at"], unique=False
    )
    op.create_index(
        op.f("ix_process_samples_process_sampled_at"),
        "process_samples",
        ["process", "sampled_at"],
        unique=False,
    )


def _create_console_audit() -> None:
    """One row per action taken in the console."""
    op.create_table(
        "console_audit",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column(
            "at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("actor", sa.Text(), nullable=False, comment="the console user's name"),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column(
            "target",
            sa.Text(),
            nullable=False,
            comment="what it acted on, as the user chose it",
        ),
        sa.Column("count", sa.Integer(), nullable=False, comment="how many it acted on"),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column(
            "detail",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_console_audit")),
    )
    op.create_index(op.f("ix_console_audit_at"), "console_audit", ["at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_console_audit_at"), table_name="console_audit")
    op.drop_table("console_audit")
    op.drop_index(op.f("ix_process_samples_process_sampled_at"), table_name="process_samples")
    op.drop_index(op.f("ix_process_samples_sampled_at"), table_name="process_samples")
    op.drop_table("process_samples")
