"""The outbox relay: committed events out to RabbitMQ, at least once, in order per ordering key.

A row is deleted only after the broker confirmed it, and only in the transaction that claimed it,
so a crash anywhere publishes it again (same message id) rather than losing it. An ordering key's
rows go out one at a time, in id order, which is their commit order, and never past a failed one.

One batch is one transaction on a connection of its own: claim due rows (``FOR UPDATE SKIP
LOCKED``, oldest first), publish them persistent and ``mandatory`` with publisher confirms, delete
the confirmed ones in one statement, count a failure on the returned or nacked ones, commit.
Batches are pipelined: up to ``PIPELINE_DEPTH`` are in flight, and the next one is claimed as soon
as the previous one's claim returned, so one batch's confirms, delete and commit overlap the next
one's claim and publishes. Claims stay one at a time, each taking the oldest rows left.

Order under the pipeline. A batch's ordering keys are *busy* from its claim until its transaction
has ended (committed or rolled back), and each claim skips the rows of busy keys
(``claim_outbox(busy=...)``): no batch publishes a row of a key whose older row is in flight in
another batch, or has failed there and is not yet committed as failed. Once that batch has ended,
the claim's unbroken-run check (the one that keeps several relays in order) finds the older row
either deleted (confirmed) or still there, waiting for its retry, and then holds the key's later
rows back behind it. Within a batch a key's rows go one at a time, each confirm awaited before
the next; rows of other keys, or of none, go concurrently. This was chosen over pinning each key
to one of N lanes: lanes would split the outbox by a hash of the key, leave lanes idle whenever
keys are skewed (a hot key goes at one lane's pace while the others poll an empty share), and
still need the unbroken-run check against other relay processes; skipping busy keys keeps one
claim over the whole outbox, in id order, for the price of one array parameter.

A broker or database outage fails the batch it hits: it rolls back. The relay then claims nothing
more, lets the other batches in flight end on their own (commit or roll back, never cancelled),
and retries with backoff. A row the broker returns or nacks fails alone: its next try moves out
exponentially, and after ``relay_max_attempts`` it is moved to ``outbox_parked``. Once ``stop`` is
set the relay claims nothing more and waits for its batches in flight to commit.

Scheduled events wait in ``outbox_scheduled``; before a claim, the relay moves the ones the
database's clock says are due into ``outbox`` (``transport.schedule``), where they are claimed like
any other row.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker import tracing
from worker.backoff import bound_from_now, first, until_stopped
from worker.errors import Retryable
from worker.faults import RELAY_AFTER_PUBLISH, RELAY_MID_BATCH, crash_point
from worker.settings import Settings
from worker.sql import outbox
from worker.sql.outbox import OutboxRow
from worker.telemetry import Telemetry
from worker.transport.failed_events import FailedEvents
from worker.transport.publisher import Channel, channel_of, properties_of, publish_confirmed
from worker.transport.schedule import Schedule

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT = 30.0
"""Seconds a batch may wait for its confirms before the whole batch is retried."""

MIN_IDLE = 0.05
"""First wait of a relay that found less than a full batch; it doubles up to the poll interval."""

PIPELINE_DEPTH = 2
"""Batches a relay has in flight at once, each in a transaction on a connection of its own.

Two let one batch's claim, delete and commit overlap another's confirms. Three measured worse on
a 2-core machine with both services on it (e/bare 0.55-0.64 against 0.67-0.80 in alternating
runs of ``benchmarks.throughput``): the broker's confirm latency grew with the rows in flight.
The relay's pool must hold this many connections plus one for LISTEN (``runner`` gives it two,
and two more on overflow)."""

RETRY_MAX = 5.0
"""Longest wait, in seconds, before the relay tries again after its database or broker failed:
short, so that it publishes again within seconds of a network path coming back."""


def runs_to_publish(rows: Iterable[OutboxRow]) -> list[list[OutboxRow]]:
    """The runs of rows a batch publishes: all runs at once, each run's rows one at a time.

    A row without an ordering key is a run of its own; a key's rows are one run, in id order.
    But in a batch of many keys (at least half as many keys as rows that have one), each key's
    run is cut to its first row: the few rows behind a first would hold the whole batch, and the
    pipeline slot it takes, for one more round of confirms each, while cut off they simply go in
    a later batch (claimed once this one has committed and its keys are free again). A row left
    out is neither published nor failed; it stays locked until this batch ends, then waits for
    the next claim, in order.
    """
    unordered: list[list[OutboxRow]] = []
    keyed: dict[str, list[OutboxRow]] = defaultdict(list)
    for row in rows:
        if row.ordering_key is None:
            unordered.append([row])
        else:
            keyed[row.ordering_key].append(row)
    runs = list(keyed.values())
    if 2 * len(runs) >= sum(map(len, runs)):
        runs = [run[:1] for run in runs]
    return [*unordered, *runs]


def _log_rolled_back(error: BaseException) -> None:
    """Log a batch that failed beside the one whose error the relay retries (an outage fails
    every batch in flight alike)."""
    log.info("another outbox batch in flight failed too and was rolled back: %r", error)


class Relay:
    """Publishes the outbox until stopped; ``wake()`` makes it look at once.

    ``telemetry`` counts ``Count.RELAY_PUBLISHED``, ``Count.RELAY_FAILED`` (returned, nacked or
    unpublishable, to be retried) and ``Count.RELAY_PARKED``, each once its batch has committed.
    """

    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine,
        connection: AbstractRobustConnection,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.connection = connection
        self.telemetry = Telemetry() if telemetry is None else telemetry
        self._wake = asyncio.Event()
        self._channel: AbstractChannel | None = None
        self._exchanges: set[str] = set()
        """Names of the exchanges the broker was found to have."""
        self._probing = asyncio.Lock()
        self._batches: set[asyncio.Task[None]] = set()
        self._busy: set[str] = set()
        """Ordering keys of the batches in flight, until their transactions have ended."""
        self.failed_events = FailedEvents(log)
        self.schedule = Schedule(
            engine,
            batch=settings.relay_batch_size,
            poll_interval=settings.relay_poll_interval,
            telemetry=self.telemetry,
        )

    def wake(self) -> None:
        """Ask for a batch now: new rows were committed."""
        self._wake.set()

    async def start(self) -> None:
        """Open the publishing channel (confirms on, returns raised); ``run`` does it if needed."""
        if self._channel is None:
            self._channel = await self.connection.channel(
                publisher_confirms=True, on_return_raises=True
            )

    async def run(self, stop: asyncio.Event) -> None:
        """Relay batches until ``stop`` is set; the batches in flight when it is set complete.

        Cancelled (a shutdown's grace period ran out), it cancels them: they roll back, and
        their rows are published again by the next relay.
        """
        await self.start()
        assert self._channel is not None
        listener = (
            asyncio.create_task(self._listen(stop), name="outbox-listener")
            if self.settings.outbox_notify
            else None
        )
        log.info(
            "relaying the outbox (batch %d, %d in flight, %d attempts before parking)",
            self.settings.relay_batch_size,
            PIPELINE_DEPTH,
            self.settings.relay_max_attempts,
        )
        retrying = until_stopped(stop, maximum=RETRY_MAX, logger=log)
        idle = MIN_IDLE
        try:
            while not stop.is_set():
                self.failed_events.flush()
                try:
                    claimed: int = await retrying(self._relay_next, stop)
                except Exception:
                    if stop.is_set():
                        break  # an outage during shutdown: the rows stay for the next start
                    raise
                if claimed >= self.settings.relay_batch_size:
                    continue
                idle = MIN_IDLE if claimed else min(idle * 2, self.settings.relay_poll_interval)
                await self._idle(stop, min(idle, self.schedule.seconds_until_due()))
        except asyncio.CancelledError:
            for batch in self._batches:  # the shutdown's grace period ran out: roll them back
                batch.cancel()
            raise
        finally:
            await self._batches_ended()
            self.failed_events.flush(force=True)
            if listener is not None:
                listener.cancel()
                await asyncio.gather(listener, return_exceptions=True)
            if not self._channel.is_closed:
                await self._channel.close()

    async def _relay_next(self, stop: asyncio.Event) -> int:
        """Move the scheduled events that fell due into the outbox (when the schedule says to
        look), then start the next batch once the pipeline has room; returns how many rows it
        claimed.

        If a batch failed, every other batch in flight is let end first, then its error is
        raised (for ``run`` to retry with backoff, nothing in flight).
        """
        await self.schedule.move_due()
        await self._reap()
        while len(self._batches) >= PIPELINE_DEPTH:
            await asyncio.wait(self._batches, return_when=asyncio.FIRST_COMPLETED)
            await self._reap()
        if stop.is_set():
            return 0
        self._wake.clear()
        claimed: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        batch = asyncio.create_task(self._relay_batch(claimed), name="outbox-batch")
        self._batches.add(batch)
        try:
            return await claimed
        except Exception:
            await asyncio.wait([batch])  # it ends with the same error, once rolled back
            await self._reap()
            raise

    async def _reap(self) -> None:
        """Forget the batches that ended; if one failed, wait for the rest, then raise its error."""
        ended = {batch for batch in self._batches if batch.done()}
        self._batches -= ended
        errors: list[BaseException] = []
        for batch in ended:
            if not batch.cancelled() and (error := batch.exception()) is not None:
                errors.append(error)
        if errors:
            for error in errors[1:]:
                _log_rolled_back(error)
            await self._batches_ended()
            raise errors[0]

    async def _batches_ended(self) -> None:
        """Wait until every batch in flight has committed or rolled back (cancelled only when
        ``run`` is: the grace period of a shutdown ran out)."""
        batches, self._batches = self._batches, set()
        for outcome in await asyncio.gather(*batches, return_exceptions=True):
            if isinstance(outcome, Exception):
                _log_rolled_back(outcome)

    async def _relay_batch(self, claimed: asyncio.Future[int]) -> None:
        """Relay one batch in one transaction: claim, publish, delete and fail rows, commit.

        ``claimed`` gets the number of rows claimed (or the claim's error) as soon as the claim
        returns, so that the next batch can be claimed while this one's confirms are in flight.
        The batch's ordering keys stay busy until its transaction has ended.
        """
        keys: set[str] = set()
        outcome: tuple[list[int], dict[int, str], list[int]] | None = None
        try:
            async with (
                asyncio.timeout(None) as deadline,
                self.engine.connect() as conn,
                conn.begin(),
            ):
                self._bound(deadline)
                rows = await outbox.claim_outbox(
                    conn, self.settings.relay_batch_size, busy=self._busy
                )
                deadline.reschedule(None)  # publishing has its own bound (PUBLISH_TIMEOUT)
                keys = {row.ordering_key for row in rows if row.ordering_key is not None}
                self._busy |= keys
                if not claimed.done():
                    claimed.set_result(len(rows))
                if rows:
                    outcome = await self._settle(conn, rows, deadline)
        except BaseException as exc:
            if not claimed.done():
                if isinstance(exc, asyncio.CancelledError):
                    claimed.cancel()
                else:
                    claimed.set_exception(exc)
            raise
        finally:
            self._busy -= keys
        if outcome is not None:
            self._count(rows, *outcome)

    def _bound(self, deadline: asyncio.Timeout) -> None:
        """Give the batch's next database step ``database_timeout`` seconds from now."""
        bound_from_now(deadline, self.settings.database_timeout)

    async def _settle(
        self, conn: AsyncConnection, rows: list[OutboxRow], deadline: asyncio.Timeout
    ) -> tuple[list[int], dict[int, str], list[int]]:
        """Publish ``rows``, then delete the confirmed ones and count a failure on the others
        (within ``deadline``, rescheduled, through the commit); returns the published ids, the
        failed ones with their errors, and the parked ids."""
        with tracing.span("outbox publish", {"worker.batch_size": len(rows)}) as span:
            published, failed = await self._publish(rows)
            tracing.set_attribute(span, "worker.failed", len(failed))
        crash_point(RELAY_AFTER_PUBLISH)
        self._bound(deadline)
        await outbox.delete_outbox(conn, published)
        parked = await outbox.fail_outbox(
            conn,
            failed,
            max_attempts=self.settings.relay_max_attempts,
            retry_delay=self.settings.relay_retry_delay,
        )
        return published, failed, parked

    def _count(
        self,
        rows: list[OutboxRow],
        published: list[int],
        failed: dict[int, str],
        parked: list[int],
    ) -> None:
        """Count a committed batch in the metrics and stats, and its failed rows in the log's
        summary of failures per route."""
        self.telemetry.relay_batch(
            len(rows), published=len(published), failed=len(failed), parked=len(parked)
        )
        if failed:
            gone = set(parked)
            for row in rows:
                if (error := failed.get(row.id)) is not None:
                    log.debug("outbox row %d failed: %s", row.id, error)
                    self.failed_events.record(
                        (row.exchange, row.routing_key), error, parked=row.id in gone
                    )

    async def _publish(self, rows: list[OutboxRow]) -> tuple[list[int], dict[int, str]]:
        """Publish ``rows``: the ``runs_to_publish`` concurrently, each run's rows in turn, all
        on the publishing channel's current underlay (after a reconnect, the new one).

        Returns the confirmed ids and the failed ones with their errors. A key's rows after a
        failed one are neither, nor are those ``runs_to_publish`` left out: they stay for a later
        batch, behind the failed row or the key's published ones.
        """
        exists = {name: await self._exchange_exists(name) for name in {r.exchange for r in rows}}
        assert self._channel is not None
        channel = await channel_of(self._channel)
        published: list[int] = []
        failed: dict[int, str] = {}

        async def publish_in_turn(chain: Iterable[OutboxRow]) -> None:
            for row in chain:
                error = await self._publish_one(channel, row, exists[row.exchange])
                if error is not None:
                    failed[row.id] = error
                    return
                published.append(row.id)

        await first(
            asyncio.gather(*(publish_in_turn(run) for run in runs_to_publish(rows))),
            within=PUBLISH_TIMEOUT,
            on_timeout=TimeoutError(f"no publisher confirms within {PUBLISH_TIMEOUT} s"),
        )
        return published, failed

    async def _publish_one(self, channel: Channel, row: OutboxRow, exists: bool) -> str | None:
        """Publish one row on ``channel`` (``exists``: the broker has the row's exchange); the
        reason it failed, or None once the broker confirmed it."""
        if not exists:
            return f"exchange {row.exchange!r} does not exist"
        try:
            await publish_confirmed(
                channel,
                row.body,
                properties_of(row),
                exchange=row.exchange,
                routing_key=row.routing_key,
            )
        except (TypeError, ValueError) as exc:  # pamqp refuses a property it cannot encode
            return f"unpublishable: {exc}"
        except aiormq.exceptions.PublishError:
            return (
                f"returned as unroutable: no queue is bound to exchange {row.exchange!r} "
                f"for routing key {row.routing_key!r}"
            )
        except aiormq.exceptions.DeliveryError as exc:
            return f"nacked by the broker: {exc!r}"
        except aiormq.exceptions.ChannelClosed as exc:
            # e.g. the exchange was deleted since it was checked: check again on the next try
            self._exchanges.discard(row.exchange)
            raise Retryable(f"the publishing channel was closed: {exc!r}") from exc
        crash_point(RELAY_MID_BATCH)
        return None

    async def _exchange_exists(self, name: str) -> bool:
        """Whether the broker has the exchange ``name``.

        Publishing to a missing exchange would close the publishing channel and fail the whole
        batch, so existence is checked on a throwaway channel: once per name while it exists,
        once per batch while it does not, and one name at a time (one probe channel at a time,
        however many batches and rows ask).
        """
        if name == "":
            return True
        async with self._probing:
            if name not in self._exchanges:
                probe = await self.connection.channel(publisher_confirms=False)
                try:
                    await probe.get_exchange(name, ensure=True)
                except aiormq.exceptions.ChannelNotFoundEntity:
                    return False
                finally:
                    if not probe.is_closed:
                        await probe.close()
                self._exchanges.add(name)
            return True

    async def _idle(self, stop: asyncio.Event, seconds: float) -> None:
        """Wait until woken, stopped, a batch in flight ended (its keys are free again), or
        ``seconds`` passed; the batches are waited for, never cancelled."""
        waiters = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait(
                [*waiters, *self._batches], timeout=seconds, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)

    async def _listen(self, stop: asyncio.Event) -> None:
        """LISTEN for commits that added outbox rows, reconnecting after a lost connection.

        A notification only wakes the relay; polling still finds every row without one, so if
        listening fails for good the relay logs it and goes on polling.
        """
        retrying = until_stopped(stop, initial=0.5, maximum=RETRY_MAX, logger=log)
        try:
            await retrying(self._listen_once, stop)
        except Exception:
            log.exception("LISTEN %s failed; relying on polling", outbox.OUTBOX_CHANNEL)

    async def _listen_once(self, stop: asyncio.Event) -> None:
        lost = asyncio.Event()

        def on_notify(_connection: Any, _pid: int, _channel: str, payload: str) -> None:
            if payload == outbox.SCHEDULED_NOTICE:
                self.schedule.notice()
            self._wake.set()

        async with self.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            raw.add_termination_listener(lambda _: lost.set())
            await raw.add_listener(outbox.OUTBOX_CHANNEL, on_notify)
            self.schedule.notice()  # rows committed while nobody listened
            self._wake.set()
            try:
                await first(stop.wait(), lost.wait())
            finally:
                if not raw.is_closed():
                    await raw.remove_listener(outbox.OUTBOX_CHANNEL, on_notify)
        if lost.is_set() and not stop.is_set():
            raise ConnectionError("the LISTEN connection was lost")
