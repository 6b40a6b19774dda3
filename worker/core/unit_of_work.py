"""The unit of work: a batch of messages (often of one), one PostgreSQL transaction; or, for a
workflow, its run of transactions (``apply`` chooses by the handler's kind).

In that transaction the batch's idempotency keys are claimed in one statement (written completed:
nobody sees them before the commit), the handlers' business writes run, and one statement stores
their results, releases the claims of messages taken out of the batch and appends their events to
the outbox. Either all of it commits or none of it does; the caller acks the deliveries only after
``process_batch`` has returned, i.e. after the commit.

Keys are claimed in (handler, key) order, so two concurrent batches wait on each other's keys in
the same order and cannot deadlock on them; a key delivered twice in one batch runs once.

The unit of work's own steps are bounded (``UnitOfWorkConfig.database_timeout``): the claim, and
the end of the batch through its commit, each fail with ``TimeoutError`` (transient: redone)
past it, so no unit of work waits for ever on a database that does not answer. The handlers'
time between them is theirs: a handler's long query is never cut by the worker (a dead network
path still ends it, through the connection's TCP liveness, ``worker.liveness``); a handler that
wants a bound of its own sets ``SET LOCAL statement_timeout`` in its transaction.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker.core import workflows
from worker.core.claims import Settled, claim_all, settled_against
from worker.core.config import UnitOfWorkConfig
from worker.core.connection import HandlerConnection
from worker.core.contention import TAKE_TURNS, Contention
from worker.core.context import Batch, Context, recorded
from worker.core.envelope import Envelope
from worker.core.handler import Handler, HandlerKind
from worker.core.outcomes import Outcome
from worker.errors import KeyReused, MessageFailed, handler_failed, is_contention, is_transient
from worker.faults import UNIT_OF_WORK_BEFORE_COMMIT, UNIT_OF_WORK_ISOLATING, crash_point
from worker.sql.batch import finish_batch
from worker.sql.driver import in_transaction
from worker.sql.rows import InboxKey

ISOLATION_SAVEPOINT = "worker_handlers"
"""The savepoint each run of a handler group starts from, rolled back to when a handler fails."""

MAX_SAVEPOINTS = 32
"""Runs from a savepoint one transaction may make to take failing messages out before it gives
up and fails as a whole (its messages then run one per transaction): PostgreSQL tracks 64
subtransactions per transaction cheaply, and a transaction with more slows every other session's
snapshots. A run again from where a rollback left the transaction reuses its savepoint."""


@dataclass(frozen=True)
class Isolated:
    """A delivery taken out of its batch because its handler failed there (``error``): the
    others committed without it, its key was left unclaimed, and it is to run on its own."""

    error: Exception


Ended = Settled | Isolated
"""How a delivery left a batch that committed."""


async def process_batch(
    engine: AsyncEngine, envelopes: Sequence[Envelope], config: UnitOfWorkConfig
) -> list[Ended]:
    """Apply each envelope's effect exactly once per (handler, key), in one transaction that has
    committed when this returns; return each envelope's end, in the envelopes' order.

    The first delivery of a key in the batch runs; a later one of the same key is a duplicate
    (or ``KeyReused`` with another fingerprint), as is one whose key committed before. Plain
    handlers get a ``Context`` each; a batch handler gets all of its routing key's runnable
    messages at once. With events, ``config.notify`` sends one NOTIFY to listening relays with
    the commit and ``config.on_events`` is called after it.

    A handler that fails in a batch of several runnable messages does not fail the batch: its
    handler group is rolled back to the savepoint it started from and run again without the culprits
    (a plain handler's culprit is the message it was called for; a batch handler names its culprits
    with ``MessageFailed``, else they are found by bisection), and each culprit ends ``Isolated``,
    its key unclaimed, for the caller to run alone. Anything else that fails (the claim, the outbox,
    the commit, a batch of one) fails the whole transaction and nothing commits: a permanent failure
    raises ``HandlerFailed``, a transient one raises as it is.
    """
    by_key: dict[InboxKey, list[int]] = {}
    for index in sorted(range(len(envelopes)), key=lambda i: envelopes[i].inbox_key):
        by_key.setdefault(envelopes[index].inbox_key, []).append(index)
    firsts = [envelopes[indices[0]] for indices in by_key.values()]
    async with asyncio.timeout(None) as deadline, engine.connect() as conn, conn.begin():
        config.bound(deadline)
        driver = await in_transaction(conn)
        claims = await claim_all(driver, firsts)
        deadline.reschedule(None)  # the handlers' time is theirs
        runnable = [e for e in firsts if claims[e.inbox_key] is None]
        handlers_conn = HandlerConnection(conn, driver)
        contexts = [Context(handlers_conn, e, config.exchange, asyncpg=driver) for e in runnable]
        for ctx in contexts:
            ctx.batchmates = contexts
        try:
            isolation = _Isolation(
                handlers_conn, driver, config.contention, enabled=len(contexts) > 1
            )
            results = await isolation.run(contexts)
            done = [ctx for ctx in contexts if ctx.envelope.inbox_key not in isolation.culprits]
            events = recorded(done)
            config.bound(deadline)  # the end of the batch, through its commit
            await finish_batch(
                driver,
                # the claims say completed already: only a result needs writing
                [
                    (*ctx.envelope.inbox_key, results[id(ctx)])
                    for ctx in done
                    if results[id(ctx)] is not None
                ],
                list(isolation.culprits),
                events,
                notify=config.notify,
            )
            crash_point(UNIT_OF_WORK_BEFORE_COMMIT, len(envelopes))
        except Exception as exc:
            if is_transient(exc):
                raise
            raise handler_failed(exc) from exc
        finally:
            for ctx in contexts:
                await ctx.close()
    ends: dict[int, Ended] = {}
    for key, indices in by_key.items():
        first = envelopes[indices[0]]
        existing = claims[key]
        if key in isolation.culprits:  # its later copies wait for it: they run on their own too
            ends.update((index, Isolated(isolation.culprits[key])) for index in indices)
            continue
        ends[indices[0]] = (
            Outcome.PROCESSED if existing is None else settled_against(existing, first, first)
        )
        for index in indices[1:]:
            ends[index] = settled_against(existing, envelopes[index], first)
    if events:
        config.committed_events()
    return [ends[index] for index in range(len(envelopes))]


@dataclass(frozen=True)
class _FailedGroup:
    """A handler call of a group failed: ``indices`` are the culprits' places in the group where
    they are known (empty: find them), ``error`` what a culprit run alone fails with."""

    indices: tuple[int, ...]
    error: Exception


class _Isolation:
    """Runs a transaction's handler groups, each from a savepoint, taking out the messages whose
    handler fails (when ``enabled``: the transaction holds several runnable messages)."""

    def __init__(
        self, conn: AsyncConnection, driver: Any, contention: Contention, *, enabled: bool
    ) -> None:
        self.conn = conn
        self.driver = driver
        self.contention = contention
        self.enabled = enabled
        self.culprits: dict[InboxKey, Exception] = {}
        self._savepoints = 0
        self._standing = False  # just rolled back to: the savepoint is where the next run starts

    async def run(self, contexts: Sequence[Context]) -> dict[int, Any]:
        """Each surviving context's handler result, by ``id(ctx)``; a batch handler runs once
        for its consecutive contexts (they come sorted by handler), a plain one once per context."""
        results: dict[int, Any] = {}
        for handler, group in itertools.groupby(contexts, key=lambda ctx: ctx.envelope.handler):
            results.update(await self._run_group(handler, list(group)))
        return results

    async def _run_group(self, handler: Handler, members: list[Context]) -> dict[int, Any]:
        while members:
            if self.contention.contended(handler.name):
                await self.driver.execute(TAKE_TURNS, handler.name)
            if self.enabled:
                await self._savepoint()
            outcome = await _call(self.conn, self.driver, handler, members)
            if not isinstance(outcome, _FailedGroup):
                return outcome  # (its savepoint is released at commit: no round trip for it)
            if is_contention(outcome.error):
                self.contention.deadlocked(handler.name)
            if not self.enabled:
                raise outcome.error
            await self._roll_back(members)
            crash_point(UNIT_OF_WORK_ISOLATING)
            if is_contention(outcome.error):  # no message's fault: run them all again, in turn
                continue
            if not outcome.indices and len(members) > 1:  # a batch handler's, unnamed
                half = len(members) // 2
                results = await self._run_group(handler, members[:half])
                results.update(await self._run_group(handler, members[half:]))
                return results
            culprits = set(outcome.indices) or {0}
            for index in culprits:
                self.culprits[members[index].envelope.inbox_key] = outcome.error
            members = [ctx for index, ctx in enumerate(members) if index not in culprits]
        return {}

    async def _savepoint(self) -> None:
        """Mark where the next run starts: a new savepoint, unless the run starts where the last
        rollback left the transaction (a savepoint stays after a rollback to it)."""
        if self._savepoints == MAX_SAVEPOINTS:
            raise RuntimeError(
                f"gave up taking failing messages out of the batch after {MAX_SAVEPOINTS} tries"
            )
        self._savepoints += 1
        if self._standing:
            self._standing = False
            return
        await self.driver.execute(f"SAVEPOINT {ISOLATION_SAVEPOINT}")

    async def _roll_back(self, members: Sequence[Context]) -> None:
        """Undo the group's run: its writes, the events it recorded, its ORM sessions."""
        await self.driver.execute(f"ROLLBACK TO SAVEPOINT {ISOLATION_SAVEPOINT}")
        self._standing = True
        for ctx in members:
            ctx.outbox.clear()
            ctx.cancelled.clear()
            await ctx.close()


async def _call(
    conn: AsyncConnection, driver: Any, handler: Handler, members: Sequence[Context]
) -> dict[int, Any] | _FailedGroup:
    """Run ``handler`` for ``members`` and flush what they wrote: each one's result by
    ``id(ctx)``, or how it failed, naming the culprit where that is known."""
    if handler.kind is not HandlerKind.BATCH:
        results: dict[int, Any] = {}
        for index, ctx in enumerate(members):
            try:
                results[id(ctx)] = await handler.func(ctx.envelope.payload, ctx)
                await ctx.flush()
            except Exception as exc:
                return _FailedGroup((index,), exc)
        return results
    batch = Batch(conn, members, asyncpg=driver)
    try:
        returned = await handler.func([ctx.envelope.payload for ctx in members], batch)
        await batch.flush()
        for ctx in members:
            await ctx.flush()
    except MessageFailed as exc:
        named = tuple(i for i in exc.indices if 0 <= i < len(members))
        cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        return _FailedGroup(named if len(named) == len(exc.indices) else (), cause)
    except Exception as exc:
        return _FailedGroup((), exc)
    finally:
        await batch.close()
    if returned is None:
        returned = [None] * len(members)
    elif len(returned) != len(members):
        raise TypeError(
            f"batch handler {handler.name!r} returned {len(returned)} results "
            f"for {len(members)} messages"
        )
    return {id(ctx): result for ctx, result in zip(members, returned, strict=True)}


async def process(engine: AsyncEngine, envelope: Envelope, config: UnitOfWorkConfig) -> Outcome:
    """Apply one envelope's effect exactly once per (handler, key): ``process_batch`` of one.

    Raises ``KeyReused`` when the key is known with another fingerprint, ``HandlerFailed`` when
    the handler (or storing what it produced) fails permanently, and transient errors as they
    are, for the caller to retry. Whatever it raises, nothing has been committed.
    """
    [end] = await process_batch(engine, [envelope], config)
    if isinstance(end, KeyReused):
        raise end
    assert not isinstance(end, Isolated)  # (a batch of one fails as a whole)
    return end


async def apply(engine: AsyncEngine, envelope: Envelope, config: UnitOfWorkConfig) -> Outcome:
    """The unit of work of one envelope, by its handler's kind: a workflow's run of transactions
    (``workflows.run``), else one transaction (``process``). Raises as those do."""
    if envelope.handler.kind is HandlerKind.WORKFLOW:
        return await workflows.run(engine, envelope, config)
    return await process(engine, envelope, config)
