"""The unit of work: a batch of messages (often of one), one PostgreSQL transaction.

In that transaction the batch's idempotency keys are claimed in one statement, the handlers'
business writes run, their events are appended to the outbox in one statement and the keys are
marked completed in one statement. Either all of it commits or none of it does; the caller acks
the deliveries only after ``process_batch`` has returned, i.e. after the commit.

Keys are claimed in (handler, key) order, so two concurrent batches wait on each other's keys in
the same order and cannot deadlock on them; a key delivered twice in one batch runs once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker.core.context import Batch, Context
from worker.core.envelope import Envelope
from worker.core.outcomes import Outcome
from worker.errors import HandlerFailed, KeyReused, is_transient
from worker.faults import UNIT_OF_WORK_BEFORE_COMMIT, crash_point
from worker.sql import inbox, outbox
from worker.sql.inbox import InboxEntry, InboxKey

Settled = Outcome | KeyReused
"""A message's end in a batch that committed: an outcome, or the key-reused rejection."""


def inbox_key(envelope: Envelope) -> InboxKey:
    return envelope.handler.name, envelope.key


async def claim_all(
    conn: AsyncConnection,
    envelopes: Sequence[Envelope],
    *,
    owner: str | None = None,
    lease: float | None = None,
) -> dict[InboxKey, InboxEntry | None]:
    """Claim the envelopes' keys (distinct, in lock order) in ``conn``'s transaction: None for
    each key claimed, else the key's committed entry."""
    claims: dict[InboxKey, InboxEntry | None] = {}
    pending = list(envelopes)
    while pending:
        claimed = await inbox.claim_keys(conn, pending, owner=owner, lease=lease)
        claims.update(dict.fromkeys(claimed))
        taken = [e for e in pending if inbox_key(e) not in claimed]
        existing = await inbox.fetch_keys(conn, [inbox_key(e) for e in taken]) if taken else {}
        claims.update(existing)
        # a row that vanished between the two statements (the janitor): claim it again
        pending = [e for e in taken if inbox_key(e) not in existing]
    return claims


async def claim(
    conn: AsyncConnection,
    envelope: Envelope,
    *,
    owner: str | None = None,
    lease: float | None = None,
) -> InboxEntry | None:
    """Claim the envelope's key in ``conn``'s transaction: None when claimed, else the key's
    committed entry. Raises ``KeyReused`` when that entry has another fingerprint."""
    existing = (await claim_all(conn, [envelope], owner=owner, lease=lease))[inbox_key(envelope)]
    if existing is not None and existing.fingerprint != envelope.fingerprint:
        raise KeyReused()
    return existing


def duplicate(existing: InboxEntry) -> Outcome:
    """The outcome of a delivery whose key was completed, or failed, before."""
    if existing.status == "failed":
        return Outcome.DUPLICATE_OF_FAILED  # not re-run until a DLQ replay clears it
    return Outcome.DUPLICATE


def _against(existing: InboxEntry | None, envelope: Envelope, first: Envelope) -> Settled:
    """The end of a delivery that does not run: its key's committed entry decides, or, for a
    repeat inside the batch, the delivery of that key that ran (``first``)."""
    fingerprint = first.fingerprint if existing is None else existing.fingerprint
    if fingerprint != envelope.fingerprint:
        return KeyReused()
    return Outcome.DUPLICATE if existing is None else duplicate(existing)


async def process_batch(
    engine: AsyncEngine,
    envelopes: Sequence[Envelope],
    *,
    default_exchange: str,
    notify: bool = False,
    on_events: Callable[[], None] | None = None,
) -> list[Settled]:
    """Apply each envelope's effect exactly once per (handler, key), in one transaction that has
    committed when this returns; return each envelope's end, in the envelopes' order.

    The first delivery of a key in the batch runs; a later one of the same key is a duplicate
    (or ``KeyReused`` with another fingerprint), as is one whose key committed before. When any
    handler (or storing what it produced) fails, nothing commits: a permanent failure raises
    ``HandlerFailed``, a transient one raises as it is, and the caller retries the messages
    one per transaction. Plain handlers get a ``Context`` each; a batch handler gets all of its
    routing key's runnable messages at once. With events, ``notify`` sends one NOTIFY to
    listening relays with the commit and ``on_events`` is called after it.
    """
    by_key: dict[InboxKey, list[int]] = {}
    for index in sorted(range(len(envelopes)), key=lambda i: inbox_key(envelopes[i])):
        by_key.setdefault(inbox_key(envelopes[index]), []).append(index)
    firsts = [envelopes[indices[0]] for indices in by_key.values()]
    ends: dict[int, Settled] = {}
    async with engine.connect() as conn, conn.begin():
        claims = await claim_all(conn, firsts)
        runnable = [e for e in firsts if claims[inbox_key(e)] is None]
        contexts = [Context(conn, e, default_exchange) for e in runnable]
        try:
            results = await _run_handlers(conn, contexts)
            for ctx in contexts:
                await ctx.flush()
            events = [m for ctx in contexts for m in ctx.outbox]
            await outbox.append_outbox(conn, events, notify=notify)
            if runnable:
                await inbox.complete_keys(
                    conn, [(*inbox_key(e), r) for e, r in zip(runnable, results, strict=True)]
                )
            crash_point(UNIT_OF_WORK_BEFORE_COMMIT, len(envelopes))
        except Exception as exc:
            if is_transient(exc):
                raise
            raise HandlerFailed(f"{type(exc).__name__}: {exc}") from exc
        finally:
            for ctx in contexts:
                await ctx.close()
    for key, indices in by_key.items():
        first = envelopes[indices[0]]
        existing = claims[key]
        ends[indices[0]] = (
            Outcome.PROCESSED if existing is None else _against(existing, first, first)
        )
        for index in indices[1:]:
            ends[index] = _against(existing, envelopes[index], first)
    if events and on_events is not None:
        on_events()
    return [ends[index] for index in range(len(envelopes))]


async def _run_handlers(conn: AsyncConnection, contexts: Sequence[Context]) -> list[Any]:
    """Each context's handler result, in order: a batch handler runs once for its consecutive
    contexts (they come sorted by handler), a plain handler once per context."""
    results: list[Any] = []
    for handler, group in itertools.groupby(contexts, key=lambda ctx: ctx.envelope.handler):
        members = list(group)
        if not handler.batch:
            for ctx in members:
                results.append(await handler.func(ctx.envelope.payload, ctx))
            continue
        batch = Batch(conn, members)
        try:
            returned = await handler.func([ctx.envelope.payload for ctx in members], batch)
            await batch.flush()
        finally:
            await batch.close()
        if returned is None:
            returned = [None] * len(members)
        elif len(returned) != len(members):
            raise TypeError(
                f"batch handler {handler.name!r} returned {len(returned)} results "
                f"for {len(members)} messages"
            )
        results.extend(returned)
    return results


async def process(
    engine: AsyncEngine,
    envelope: Envelope,
    *,
    default_exchange: str,
    notify: bool = False,
    on_events: Callable[[], None] | None = None,
) -> Outcome:
    """Apply one envelope's effect exactly once per (handler, key): ``process_batch`` of one.

    Raises ``KeyReused`` when the key is known with another fingerprint, ``HandlerFailed`` when
    the handler (or storing what it produced) fails permanently, and transient errors as they
    are, for the caller to retry. Whatever it raises, nothing has been committed.
    """
    [end] = await process_batch(
        engine, [envelope], default_exchange=default_exchange, notify=notify, on_events=on_events
    )
    if isinstance(end, KeyReused):
        raise end
    return end
