"""The unit of work: one message, one PostgreSQL transaction.

In that transaction the idempotency key is claimed, the handler's business writes run, its events
are appended to the outbox and the key is marked completed. Either all of it commits or none of
it does; the caller acks the delivery only after ``process`` has returned, i.e. after the commit.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker import queries
from worker.context import Context
from worker.envelope import Envelope
from worker.errors import HandlerFailed, KeyReused, is_transient
from worker.faults import UNIT_OF_WORK_BEFORE_COMMIT, crash_point
from worker.queries import InboxEntry


class Outcome(enum.Enum):
    """How a unit of work ended, when it did not raise."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"
    DUPLICATE_OF_FAILED = "duplicate_of_failed"


async def claim(
    conn: AsyncConnection,
    envelope: Envelope,
    *,
    owner: str | None = None,
    lease: float | None = None,
) -> InboxEntry | None:
    """Claim the envelope's key in ``conn``'s transaction: None when claimed, else the key's
    committed entry. Raises ``KeyReused`` when that entry has another fingerprint."""
    while not await queries.claim_key(conn, envelope, owner=owner, lease=lease):
        existing = await queries.fetch_key(conn, envelope.handler.name, envelope.key)
        if existing is None:
            continue  # the row vanished between the two statements: claim again
        if existing.fingerprint != envelope.fingerprint:
            raise KeyReused()
        return existing
    return None


def duplicate(existing: InboxEntry) -> Outcome:
    """The outcome of a delivery whose key was completed, or failed, before."""
    if existing.status == "failed":
        return Outcome.DUPLICATE_OF_FAILED  # not re-run until a DLQ replay clears it
    return Outcome.DUPLICATE


async def process(
    engine: AsyncEngine,
    envelope: Envelope,
    *,
    default_exchange: str,
    notify: bool = False,
    on_events: Callable[[], None] | None = None,
) -> Outcome:
    """Apply ``envelope``'s effect exactly once per (handler, key), committing before returning.

    When the handler published events, ``notify`` sends one NOTIFY to listening relays with the
    commit, and ``on_events`` is called after the commit (to wake an in-process relay).

    Raises ``KeyReused`` when the key is known with another fingerprint, ``HandlerFailed`` when
    the handler (or storing what it produced) fails permanently, and transient errors as they
    are, for the caller to retry. Whatever it raises, nothing has been committed.
    """
    handler = envelope.handler
    async with engine.connect() as conn, conn.begin():
        existing = await claim(conn, envelope)
        if existing is not None:
            return duplicate(existing)

        ctx = Context(conn, envelope, default_exchange)
        try:
            result = await handler.func(envelope.payload, ctx)
            await ctx.flush()
            await queries.append_outbox(conn, ctx.outbox, notify=notify)
            await queries.complete_key(conn, handler.name, envelope.key, result)
            crash_point(UNIT_OF_WORK_BEFORE_COMMIT)
        except Exception as exc:
            if is_transient(exc):
                raise
            raise HandlerFailed(f"{type(exc).__name__}: {exc}") from exc
        finally:
            await ctx.close()
    if ctx.outbox and on_events is not None:
        on_events()
    return Outcome.PROCESSED
