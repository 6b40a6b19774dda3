"""The worker's own tables. Migrations in ``worker/migrations`` create exactly this metadata.

``inbox`` holds one row per (handler, idempotency key) whose effect has committed, or failed, or
(for a workflow) is under way between steps under its owner's lease; ``workflow_steps`` holds the
output of each committed step of a workflow; ``workflow_waits`` one row per wait of a workflow
(for a signal with a timeout, or a sleep), open until its signal or its deadline resolves it;
``workflow_signals`` the signals that arrived when no wait was open for them; ``outbox`` holds
events committed with an effect and not yet confirmed by the broker; ``outbox_scheduled`` holds
events scheduled for later, moved into ``outbox`` when due; ``outbox_parked`` holds events the
relay gave up on after its last attempt, for an operator to inspect and retry;
``ingress_requests`` holds one row per (handler, client, idempotency key) that the HTTP ingress
accepted, with the key its handler runs under, its payload's fingerprint and the message id of
the event it appended; ``dead_letters`` holds one row per copy the worker itself parked in the
dead-letter queue, the provenance ``worker dlq`` checks before it replays one;
``process_samples`` holds what each running worker and relay process reports of itself every few
seconds (its state, its counters, the backlogs it sees), kept for ``SAMPLES_KEPT``: what ``worker
status`` and the console show of every process; ``console_audit`` one row per action taken in the
console (who, what, when, how many).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKeyConstraint,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    Uuid,
    bindparam,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
"""Constraint and index names that autogenerate reproduces; handler modules may use it too."""

metadata = MetaData(naming_convention=NAMING_CONVENTION)

INBOX_STATUSES = ("in_progress", "completed", "failed")

inbox = Table(
    "inbox",
    metadata,
    Column("handler", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("fingerprint", LargeBinary, nullable=False, comment="SHA-256 of the canonical body"),
    Column("status", Text, nullable=False),
    Column("recovery_point", Text, nullable=True),
    Column("result", JSONB, nullable=True),
    Column("error", Text, nullable=True),
    Column("attempts", Integer, nullable=False, server_default=text("1")),
    Column("message_id", Text, nullable=True),
    Column("routing_key", Text, nullable=False),
    Column("owner", Text, nullable=True, comment="the delivery running this workflow"),
    Column("lease_until", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("handler", "key"),
    CheckConstraint("status IN ('in_progress', 'completed', 'failed')", name="status"),
    Index(None, "updated_at"),
    Index("ix_inbox_in_progress", "updated_at", postgresql_where=text("status = 'in_progress'")),
)

workflow_steps = Table(
    "workflow_steps",
    metadata,
    Column("handler", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("step", Text, nullable=False),
    Column("position", Integer, nullable=False),
    Column("output", JSONB, nullable=True),
    Column("completed_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("handler", "key", "step"),
    ForeignKeyConstraint(["handler", "key"], ["inbox.handler", "inbox.key"], ondelete="CASCADE"),
)

workflow_waits = Table(
    "workflow_waits",
    metadata,
    Column("handler", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("name", Text, nullable=False, comment="the wait's name, in the namespace of steps"),
    Column("routing_key", Text, nullable=True, comment="the signal waited for; NULL: a sleep"),
    Column("correlation", Text, nullable=True),
    Column("due_at", DateTime(timezone=True), nullable=False, comment="by the database's clock"),
    Column("timer_id", Uuid, nullable=True, comment="message id of the scheduled resume"),
    Column("resume_exchange", Text, nullable=False),
    Column("resume_routing_key", Text, nullable=False),
    Column("resume_body", LargeBinary, nullable=False),
    Column("resume_content_type", Text, nullable=False),
    Column("resume_headers", JSONB, nullable=False),
    Column("resume_correlation_id", Text, nullable=True),
    Column("outcome", Text, nullable=True),
    Column("event", JSONB, nullable=True, comment="what resolved it: body and message id"),
    Column("resolved_at", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("handler", "key", "name"),
    ForeignKeyConstraint(["handler", "key"], ["inbox.handler", "inbox.key"], ondelete="CASCADE"),
    CheckConstraint("outcome IN ('event', 'timeout')", name="outcome"),
    Index(
        "ix_workflow_waits_open_correlation",
        "routing_key",
        "correlation",
        postgresql_where=text("outcome IS NULL"),
    ),
    Index("ix_workflow_waits_open_due_at", "due_at", postgresql_where=text("outcome IS NULL")),
)

workflow_signals = Table(
    "workflow_signals",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("routing_key", Text, nullable=False),
    Column("correlation", Text, nullable=False),
    Column("message_id", Text, nullable=True),
    Column("event", JSONB, nullable=False),
    Column("received_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("consumed_at", DateTime(timezone=True), nullable=True),
    Column("consumed_by_handler", Text, nullable=True),
    Column("consumed_by_key", Text, nullable=True),
    Index(
        "ix_workflow_signals_unconsumed",
        "routing_key",
        "correlation",
        "id",
        postgresql_where=text("consumed_at IS NULL"),
    ),
    Index(None, "received_at"),
)


def _event_columns() -> list[Column[Any]]:
    """The columns of an event to publish, as ``outbox`` and ``outbox_scheduled`` both hold it
    (new objects each call: a column belongs to one table)."""
    return [
        Column("message_id", Uuid, nullable=False, unique=True),
        Column("exchange", Text, nullable=False),
        Column("routing_key", Text, nullable=False),
        Column("body", LargeBinary, nullable=False),
        Column("content_type", Text, nullable=False),
        Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
        Column("correlation_id", Text, nullable=True),
        Column("causation_id", Text, nullable=True),
        Column("ordering_key", Text, nullable=True),
    ]


outbox = Table(
    "outbox",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    *_event_columns(),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("last_error", Text, nullable=True),
    Column("available_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index(None, "available_at", "id"),
    Index(
        None,
        "ordering_key",
        "id",
        postgresql_where=text("ordering_key IS NOT NULL"),
    ),
)

outbox_scheduled = Table(
    "outbox_scheduled",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    *_event_columns(),
    Column("due_at", DateTime(timezone=True), nullable=False, comment="by the database's clock"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index(None, "due_at", "id"),
    Index(
        None,
        "ordering_key",
        "due_at",
        "id",
        postgresql_where=text("ordering_key IS NOT NULL"),
    ),
)

outbox_parked = Table(
    "outbox_parked",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=False, comment="the outbox id"),
    Column("message_id", Uuid, nullable=False, unique=True),
    Column("exchange", Text, nullable=False),
    Column("routing_key", Text, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("content_type", Text, nullable=False),
    Column("headers", JSONB, nullable=False),
    Column("correlation_id", Text, nullable=True),
    Column("causation_id", Text, nullable=True),
    Column("ordering_key", Text, nullable=True),
    Column("attempts", Integer, nullable=False),
    Column("last_error", Text, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("parked_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

CLIENT_COMMENT = "the client that posted it; empty: accepted before clients were told apart"

ingress_requests = Table(
    "ingress_requests",
    metadata,
    Column("handler", Text, nullable=False, comment="the handler of the routing key posted to"),
    Column("client", Text, nullable=False, comment=CLIENT_COMMENT),
    Column("key", Text, nullable=False, comment="the client's Idempotency-Key"),
    Column("handler_key", Text, nullable=False, comment="the key its handler runs under"),
    Column("routing_key", Text, nullable=False),
    Column("fingerprint", LargeBinary, nullable=False, comment="SHA-256 of the canonical body"),
    Column("message_id", Uuid, nullable=False, comment="the event appended to the outbox"),
    Column("accepted_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("handler", "client", "key"),
    Index(None, "accepted_at"),
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("parking_id", Uuid, primary_key=True, comment="the copy's x-worker-parking-id"),
    Column("handler", Text, nullable=True),
    Column("key", Text, nullable=True, comment="the idempotency key the copy was parked with"),
    Column("reason", Text, nullable=False),
    Column("routing_key", Text, nullable=False),
    Column("body_sha256", LargeBinary, nullable=False, comment="SHA-256 of the copy's body"),
    Column(
        "failed_key",
        Boolean,
        nullable=False,
        comment="(handler, key) was recorded as failed in the inbox with this parking",
    ),
    Column("parked_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column(
        "error",
        Text,
        nullable=True,
        comment="the failure the copy was parked for, as the worker wrote it",
    ),
    Column(
        "exception_type", Text, nullable=True, comment="the type of the exception that failed it"
    ),
    Column(
        "attempts",
        Integer,
        nullable=True,
        comment="failed deliveries of the message, this one included",
    ),
    Column(
        "first_failure_at", Text, nullable=True, comment="when its first delivery failed (ISO 8601)"
    ),
    Column(
        "replayed_at",
        DateTime(timezone=True),
        nullable=True,
        comment="when its copy was replayed, if it was",
    ),
    Index(None, "parked_at"),
    Index(None, "handler", "key"),
)


process_samples = Table(
    "process_samples",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("process", Text, nullable=False, comment="host:pid:start, unique per process run"),
    Column("role", Text, nullable=False, comment="worker or relay"),
    Column("host", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("sampled_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("state", Text, nullable=False, comment="consuming, paused, throttled, draining, ..."),
    Column("reason", Text, nullable=True, comment="why it is paused, when it is"),
    Column("counters", JSONB, nullable=False, comment="its counters since it started"),
    Column("gauges", JSONB, nullable=False, comment="the backlogs it saw"),
    Index(None, "sampled_at"),
    Index(None, "process", "sampled_at"),
)

console_audit = Table(
    "console_audit",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("actor", Text, nullable=False, comment="the console user's name"),
    Column("role", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("target", Text, nullable=False, comment="what it acted on, as the user chose it"),
    Column("count", Integer, nullable=False, comment="how many it acted on"),
    Column("outcome", Text, nullable=False),
    Column("detail", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column(
        "repeats",
        Integer,
        nullable=False,
        server_default=text("1"),
        comment="how many times it happened: a refusal repeated within a window counts here",
    ),
    Column(
        "last_at",
        DateTime(timezone=True),
        nullable=True,
        comment="when it last happened, for an entry repeated",
    ),
    Index(None, "at"),
)


def interval(value: float) -> Any:
    """An SQL interval of ``value`` seconds, for the SQLAlchemy Core statements on these tables."""
    return func.make_interval(0, 0, 0, 0, 0, 0, bindparam(None, value, type_=Float))
