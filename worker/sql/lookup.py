"""Reads of one thing by its key, for the console: an unpublished event by its id (with its
headers and body), an inbox key with its stored result or error, a workflow's steps and waits,
and the keys updated last.

Invariant: every statement reads a primary key, or a range of an index with a LIMIT, so it
costs the same however large the inbox and the outbox grow (``tests/integration/
test_console_plans.py`` checks their plans); and every value a message or a handler made (a
body, headers, a result, an error, a step's output, the event that resolved a wait) is cut in
the database to the number of characters (bytes, for a body) asked for, with its full size
beside it, so one huge value costs a page no more than ``cap``. Each ``*_query`` function builds
the statement its reader runs, for the plans' test to explain.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Text, case, cast, func, literal, null, select
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.sql.tables import (
    inbox,
    outbox,
    outbox_parked,
    outbox_scheduled,
    workflow_steps,
    workflow_waits,
)
from worker.sql.waits import TIMER_HEADER

OUTBOX_TABLES = ("scheduled", "outbox", "parked")
"""Where an unpublished event is: ``outbox_scheduled``, ``outbox`` (pending or backing off)
or ``outbox_parked``."""


def _clipped_text(value: Any, cap: int, name: str) -> list[Any]:
    """``value`` (text, or JSON as text) cut to ``cap`` characters, and its length."""
    as_text = value if isinstance(value.type, Text) else cast(value, Text)
    return [func.left(as_text, cap).label(name), func.length(as_text).label(f"{name}_size")]


def _clipped_bytes(value: Any, cap: int, name: str) -> list[Any]:
    """``value`` (bytea) cut to ``cap`` bytes, and its length in bytes."""
    return [
        func.substring(value, 1, cap).label(name),
        func.octet_length(value).label(f"{name}_size"),
    ]


@dataclass(frozen=True)
class OutboxRow:
    """One unpublished event as its own page shows it: ``state`` one of
    ``inspection.OUTBOX_STATES``; ``available_at`` when a relay may next publish it (a
    scheduled event's ``due_at``; None when parked); ``headers`` as JSON text and ``body`` as
    bytes, each cut (``headers_size`` characters and ``body_size`` bytes in full), and so is
    ``last_error``; ``timer`` the name of the wait it ends, for a waiting workflow's timer."""

    state: str
    id: int
    message_id: uuid.UUID
    exchange: str
    routing_key: str
    ordering_key: str | None
    content_type: str
    correlation_id: str | None
    causation_id: str | None
    attempts: int
    last_error: str | None
    last_error_size: int | None
    created_at: datetime
    available_at: datetime | None
    parked_at: datetime | None
    timer: str | None
    headers: str
    headers_size: int
    body: bytes
    body_size: int


def outbox_row_query(table: str, row_id: int, cap: int) -> Any:
    """The statement of ``outbox_row``."""
    state: Any
    when: list[Any]
    failed: list[Any]
    if table == "scheduled":
        source = outbox_scheduled
        state = literal("scheduled")
        when = [source.c.due_at.label("available_at"), null().label("parked_at")]
        failed = [literal(0).label("attempts"), null().label("last_error")]
        failed.append(null().label("last_error_size"))
    elif table == "parked":
        source = outbox_parked
        state = literal("parked")
        when = [null().label("available_at"), source.c.parked_at]
        failed = [source.c.attempts, *_clipped_text(source.c.last_error, cap, "last_error")]
    else:
        source = outbox
        due = source.c.available_at <= func.now()
        state = case((due, "pending"), else_="backing-off")
        when = [source.c.available_at, null().label("parked_at")]
        failed = [source.c.attempts, *_clipped_text(source.c.last_error, cap, "last_error")]
    c = source.c
    return select(
        state.label("state"),
        *(c[name] for name in ("id", "message_id", "exchange", "routing_key", "ordering_key")),
        *(c[name] for name in ("content_type", "correlation_id", "causation_id")),
        *failed,
        c.created_at,
        *when,
        c.headers[TIMER_HEADER].astext.label("timer"),
        *_clipped_text(c.headers, cap, "headers"),
        *_clipped_bytes(c.body, cap, "body"),
    ).where(c.id == row_id)


async def outbox_row(conn: AsyncConnection, table: str, row_id: int, cap: int) -> OutboxRow | None:
    """The event ``row_id`` of ``table`` (one of ``OUTBOX_TABLES``), by its primary key, with
    its headers, body and last error cut to ``cap``; None when it is not there (published,
    cancelled, moved, or never an id of that table)."""
    row = (await conn.execute(outbox_row_query(table, row_id, cap))).one_or_none()
    return None if row is None else OutboxRow(**row._asdict())


@dataclass(frozen=True)
class InboxRecord:
    """An inbox key as the lookup shows it: ``result`` (as JSON text) and ``error`` cut,
    ``result_size`` and ``error_size`` their full lengths (None when there is none)."""

    handler: str
    key: str
    status: str
    attempts: int
    fingerprint: bytes
    recovery_point: str | None
    message_id: str | None
    routing_key: str
    owner: str | None
    lease_until: datetime | None
    created_at: datetime
    updated_at: datetime
    result: str | None
    result_size: int | None
    error: str | None
    error_size: int | None


_CLIPPED_INBOX = {"result", "result_size", "error", "error_size"}


def inbox_entry_query(handler: str, key: str, cap: int) -> Any:
    """The statement of ``inbox_entry``."""
    c = inbox.c
    plain = [name for name in InboxRecord.__dataclass_fields__ if name not in _CLIPPED_INBOX]
    return select(
        *(c[name] for name in plain),
        *_clipped_text(c.result, cap, "result"),
        *_clipped_text(c.error, cap, "error"),
    ).where(c.handler == handler, c.key == key)


async def inbox_entry(
    conn: AsyncConnection, handler: str, key: str, cap: int
) -> InboxRecord | None:
    """The inbox row of (``handler``, ``key``), by its primary key, with its result and error
    cut to ``cap`` characters; None when the inbox has no such key (never claimed, or deleted
    by the retention sweep)."""
    row = (await conn.execute(inbox_entry_query(handler, key, cap))).one_or_none()
    return None if row is None else InboxRecord(**row._asdict())


@dataclass(frozen=True)
class StepRecord:
    """A committed step of a workflow: its output as JSON text, cut (``output_size`` in full)."""

    step: str
    position: int
    completed_at: datetime
    output: str | None
    output_size: int | None


def workflow_steps_query(handler: str, key: str, limit: int, cap: int) -> Any:
    """The statement of ``steps_of``."""
    c = workflow_steps.c
    return (
        select(c.step, c.position, c.completed_at, *_clipped_text(c.output, cap, "output"))
        .where(c.handler == handler, c.key == key)
        .order_by(c.position, c.step)
        .limit(limit)
    )


async def steps_of(
    conn: AsyncConnection, handler: str, key: str, limit: int, cap: int
) -> list[StepRecord]:
    """The first ``limit`` committed steps of the workflow (``handler``, ``key``), in the order
    they ran (a range of ``workflow_steps``' primary key)."""
    rows = await conn.execute(workflow_steps_query(handler, key, limit, cap))
    return [StepRecord(**row._asdict()) for row in rows]


@dataclass(frozen=True)
class WaitRecord:
    """A wait of a workflow: for the signal ``routing_key`` with ``correlation``, or a sleep
    (``routing_key`` None), until ``due_at`` by the database's clock; open while ``outcome`` is
    None, else resolved by an ``event`` or a ``timeout`` at ``resolved_at``. ``event`` (what
    resolved it, as JSON text) is cut, ``event_size`` in full. ``timer_id`` is the message id of
    its timer (``/outbox`` lists it as a scheduled event while the wait is open)."""

    name: str
    routing_key: str | None
    correlation: str | None
    due_at: datetime
    timer_id: uuid.UUID | None
    outcome: str | None
    resolved_at: datetime | None
    created_at: datetime
    event: str | None
    event_size: int | None


def workflow_waits_query(handler: str, key: str, limit: int, cap: int) -> Any:
    """The statement of ``waits_of``."""
    c = workflow_waits.c
    plain = ("name", "routing_key", "correlation", "due_at", "timer_id", "outcome")
    return (
        select(
            *(c[name] for name in plain),
            c.resolved_at,
            c.created_at,
            *_clipped_text(c.event, cap, "event"),
        )
        .where(c.handler == handler, c.key == key)
        .order_by(c.created_at, c.name)
        .limit(limit)
    )


async def waits_of(
    conn: AsyncConnection, handler: str, key: str, limit: int, cap: int
) -> list[WaitRecord]:
    """The first ``limit`` waits of the workflow (``handler``, ``key``), oldest first (a range
    of ``workflow_waits``' primary key)."""
    rows = await conn.execute(workflow_waits_query(handler, key, limit, cap))
    return [WaitRecord(**row._asdict()) for row in rows]


@dataclass(frozen=True)
class RecentKey:
    """An inbox key among the last updated."""

    handler: str
    key: str
    status: str
    updated_at: datetime


def recent_keys_query(limit: int) -> Any:
    """The statement of ``recent_keys``."""
    c = inbox.c
    return (
        select(c.handler, c.key, c.status, c.updated_at).order_by(c.updated_at.desc()).limit(limit)
    )


async def recent_keys(conn: AsyncConnection, limit: int) -> list[RecentKey]:
    """The ``limit`` inbox keys updated last, newest first (the end of the ``updated_at``
    index, read backwards)."""
    return [RecentKey(**row._asdict()) for row in await conn.execute(recent_keys_query(limit))]
