"""The unit of work: a batch of messages (often of one), one PostgreSQL transaction; or, for a
workflow, its run of transactions (``apply`` chooses by the handler's kind).

In that transaction the batch's idempotency keys are claimed in one statement, the handlers'
business writes run, their events are appended to the outbox in one statement and the keys are
marked completed in one statement. Either all of it commits or none of it does; the caller acks
the deliveries only after ``process_batch`` has returned, i.e. after the commit.

Keys are claimed in (handler, key) order, so two concurrent batches wait on each other's keys in
the same order and cannot deadlock on them; a key delivered twice in one batch runs once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker.core import workflows
from worker.core.claims import Settled, claim_all, settled_against
from worker.core.config import UnitOfWorkConfig
from worker.core.context import Batch, Context
from worker.core.envelope import Envelope
from worker.core.handler import HandlerKind
from worker.core.outcomes import Outcome
from worker.errors import HandlerFailed, KeyReused, is_transient
from worker.faults import UNIT_OF_WORK_BEFORE_COMMIT, crash_point
from worker.sql import inbox, outbox
from worker.sql.rows import InboxKey


async def process_batch(
    engine: AsyncEngine, envelopes: Sequence[Envelope], config: UnitOfWorkConfig
) -> list[Settled]:
    """Apply each envelope's effect exactly once per (handler, key), in one transaction that has
    committed when this returns; return each envelope's end, in the envelopes' order.

    The first delivery of a key in the batch runs; a later one of the same key is a duplicate
    (or ``KeyReused`` with another fingerprint), as is one whose key committed before. When any
    handler (or storing what it produced) fails, nothing commits: a permanent failure raises
    ``HandlerFailed``, a transient one raises as it is, and the caller retries the messages
    one per transaction. Plain handlers get a ``Context`` each; a batch handler gets all of its
    routing key's runnable messages at once. With events, ``config.notify`` sends one NOTIFY to
    listening relays with the commit and ``config.on_events`` is called after it.
    """
    by_key: dict[InboxKey, list[int]] = {}
    for index in sorted(range(len(envelopes)), key=lambda i: envelopes[i].inbox_key):
        by_key.setdefault(envelopes[index].inbox_key, []).append(index)
    firsts = [envelopes[indices[0]] for indices in by_key.values()]
    ends: dict[int, Settled] = {}
    async with engine.connect() as conn, conn.begin():
        claims = await claim_all(conn, firsts)
        runnable = [e for e in firsts if claims[e.inbox_key] is None]
        contexts = [Context(conn, e, config.exchange) for e in runnable]
        try:
            results = await _run_handlers(conn, contexts)
            for ctx in contexts:
                await ctx.flush()
            events = [m for ctx in contexts for m in ctx.outbox]
            await outbox.append_outbox(conn, events, notify=config.notify)
            if runnable:
                await inbox.complete_keys(
                    conn, [(*e.inbox_key, r) for e, r in zip(runnable, results, strict=True)]
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
            Outcome.PROCESSED if existing is None else settled_against(existing, first, first)
        )
        for index in indices[1:]:
            ends[index] = settled_against(existing, envelopes[index], first)
    if events:
        config.committed_events()
    return [ends[index] for index in range(len(envelopes))]


async def _run_handlers(conn: AsyncConnection, contexts: Sequence[Context]) -> list[Any]:
    """Each context's handler result, in order: a batch handler runs once for its consecutive
    contexts (they come sorted by handler), a plain handler once per context."""
    results: list[Any] = []
    for handler, group in itertools.groupby(contexts, key=lambda ctx: ctx.envelope.handler):
        members = list(group)
        if handler.kind is not HandlerKind.BATCH:
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


async def process(engine: AsyncEngine, envelope: Envelope, config: UnitOfWorkConfig) -> Outcome:
    """Apply one envelope's effect exactly once per (handler, key): ``process_batch`` of one.

    Raises ``KeyReused`` when the key is known with another fingerprint, ``HandlerFailed`` when
    the handler (or storing what it produced) fails permanently, and transient errors as they
    are, for the caller to retry. Whatever it raises, nothing has been committed.
    """
    [end] = await process_batch(engine, [envelope], config)
    if isinstance(end, KeyReused):
        raise end
    return end


async def apply(engine: AsyncEngine, envelope: Envelope, config: UnitOfWorkConfig) -> Outcome:
    """The unit of work of one envelope, by its handler's kind: a workflow's run of transactions
    (``workflows.run``), else one transaction (``process``). Raises as those do."""
    if envelope.handler.kind is HandlerKind.WORKFLOW:
        return await workflows.run(engine, envelope, config)
    return await process(engine, envelope, config)
