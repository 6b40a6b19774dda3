"""The consumer: deliveries in, units of work, acks out — an ack only ever after a commit.

Deliveries are taken in micro-batches: ``concurrency`` takers each take up to ``batch_size`` of
the deliveries that arrived (waiting ``batch_linger`` for more when there are fewer), check them
(``open_envelope``), process them in one transaction (``unit_of_work.process_batch``) and ack
them after its commit, with one multiple-ack where that is safe (``acks``). A delivery whose
handler fails in a batch is taken out of it and the others commit (``unit_of_work``); after the
commit, those that failed for good take their failure path together (``after_commit``), and the
others run alone. A batch that fails as a whole is redone one delivery per transaction. So only
a failing delivery takes the failure path (``failures``; where it ends is ``core.policy``'s
decision); while the consumer is paused (``pause``) or throttled (``streak``) it takes less.
Nothing a message holds can raise past the checks: an unexpected error while opening it is a
``CheckFailed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import backoff, logs, tracing
from worker.backoff import first
from worker.core import keyspace, unit_of_work
from worker.core.batches import after_commit, grouped
from worker.core.config import UnitOfWorkConfig
from worker.core.envelope import (
    ROUTING_KEY_HEADER,
    Delivery,
    Envelope,
    open_envelope,
)
from worker.core.offload import checked_off_loop
from worker.core.outcomes import Outcome
from worker.core.router import Router
from worker.errors import (
    PauseReason,
)
from worker.faults import (
    CONSUMER_AFTER_COMMIT,
    CONSUMER_BEFORE_CLAIM,
    CONSUMER_DRAINING,
    crash_point,
)
from worker.settings import Settings
from worker.telemetry import Count, Telemetry
from worker.transport.acks import Settlements, channel_closed
from worker.transport.copies import CopyPublisher
from worker.transport.deliveries import Received
from worker.transport.failures import Failures
from worker.transport.pause import PauseGate
from worker.transport.streak import DeadLetterStreak
from worker.transport.subscription import Subscription
from worker.transport.topology import Topology

log = logging.getLogger(__name__)


def delivery_from_amqp(message: Received) -> Delivery:
    """The transport-neutral facts of a delivery taken from the broker.

    A message that came through the default exchange (back from a delayed retry, or replayed
    from the DLQ) is routed by the routing key it was first published with.
    """
    headers = dict(message.headers)
    routing_key = message.routing_key
    original = headers.get(ROUTING_KEY_HEADER)
    if isinstance(original, bytes):
        original = original.decode("utf-8", "replace")
    if not message.exchange and isinstance(original, str) and original:
        routing_key = original
    return Delivery(
        body=message.body,
        routing_key=routing_key,
        headers=headers,
        message_id=message.message_id,
        correlation_id=message.correlation_id,
        content_type=message.content_type,
        exchange=message.exchange,
        redelivered=message.redelivered,
    )


async def _together(*work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` at once to its end, every one (none is cancelled: one may hold a
    transaction); then raise the first error, if any."""
    for outcome in await asyncio.gather(*work, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


@dataclass(frozen=True)
class _Refused:
    """The deliveries of a batch whose keys of the ingress's space may not run: ``reserved``
    (the ingress accepted no such request) and ``unanswered`` (the database could not say)."""

    reserved: list[tuple[Received, Envelope, Exception]]
    unanswered: list[tuple[Received, Envelope, Exception]]


class Consumer:
    """Consumes the work queue on one channel, ``concurrency`` transactions at a time, counting
    in ``telemetry`` (how each delivery ended, once, and the ``Count`` of its batches)."""

    def __init__(
        self,
        settings: Settings,
        router: Router,
        engine: AsyncEngine,
        connection: AbstractRobustConnection,
        telemetry: Telemetry | None = None,
        on_events: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.telemetry = Telemetry() if telemetry is None else telemetry
        self.unit_of_work = UnitOfWorkConfig(
            exchange=settings.exchange,
            notify=settings.outbox_notify,
            on_events=on_events,
            workflow_lease=settings.workflow_lease,
            database_timeout=settings.database_timeout,
        )
        self.router = router
        self.engine = engine
        self.connection = connection
        self.settlements = Settlements(hold=self.ack_hold, telemetry=self.telemetry)
        self._pending: list[Received] = []
        self.taken: list[Received] = []
        """The deliveries of the batch taken last (the process's sampler reads how long they
        waited in the queue): set once per batch, the only cost sampling adds here."""
        self._arrived = asyncio.Event()
        self._takers: list[asyncio.Task[None]] = []
        self._in_flight: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._one_at_a_time = asyncio.Lock()
        self.subscription = Subscription(settings, router, self._on_message)
        self.gate = PauseGate(
            settings, router, engine, self.subscription, self.telemetry, self._stopping
        )
        self.streak = DeadLetterStreak(settings, self.telemetry)
        self.copies = CopyPublisher(
            settings, self.subscription, self.settlements, self.telemetry, self.streak, self.gate
        )
        self.failures = Failures(
            settings, router, engine, self.copies, self.gate, self.streak, self.telemetry
        )
        self._failure: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def consuming(self) -> bool:
        """True while a consumer is attached to the work queue on an open channel."""
        return self.subscription.consuming

    @property
    def paused(self) -> bool:
        """True while consumption waits for PostgreSQL to answer again, or for a deployment
        fault to be fixed."""
        return self.gate.paused

    @property
    def throttled(self) -> bool:
        """True while dead letters in a row hold the consumer to one message at a time."""
        return self.streak.throttled

    def condition(self) -> dict[str, object]:
        """What ``/healthz`` shows of the consumer beyond ``consuming``: why it is paused, if it
        is, and whether it is throttled."""
        state: dict[str, object] = {"throttled": self.throttled}
        if self.gate.reason is not None:
            state["paused"] = self.gate.reason.value
            state["paused_because"] = self.gate.detail
        return state

    async def start(self) -> Topology:
        """Declare the topology and start consuming."""
        topology = await self.subscription.open(self.connection)
        for _ in range(self.settings.concurrency):
            taker = asyncio.create_task(self._take())
            taker.add_done_callback(self._taker_ended)
            self._takers.append(taker)
        await self.subscription.consume()
        log.info(
            "consuming queue %r (routing keys: %s; prefetch %d, concurrency %d, batch size %d)",
            self.settings.queue,
            ", ".join(self.router.routing_keys()) or "none",
            self.settings.prefetch,
            self.settings.concurrency,
            self.batch_size,
        )
        return topology

    @property
    def ack_hold(self) -> int:
        """Committed deliveries whose acks may wait for a multiple-ack behind deliveries still in
        flight (``acks``): what the prefetch window holds beyond a batch in flight per consumer
        task and one more waiting to be taken, so that holding them never starves a task."""
        return max(0, self.settings.prefetch - (self.settings.concurrency + 1) * self.batch_size)

    @property
    def batch_size(self) -> int:
        """Most deliveries one transaction takes: the setting, bounded by the prefetch."""
        return min(self.settings.batch_size, self.settings.prefetch)

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking deliveries, let the ones in flight commit and ack, then close the channel.

        Deliveries still in flight after ``grace`` seconds are cancelled: their transactions roll
        back and they are never acked, so the broker delivers them again. Prefetched deliveries
        that never started go back to the queue when the channel closes.
        """
        self._stopping.set()
        self._arrived.set()  # takers see the stop and take nothing more
        await self.gate.resumed()
        await self.subscription.cancel()
        crash_point(CONSUMER_DRAINING)
        if self._in_flight:
            _, late = await asyncio.wait(set(self._in_flight), timeout=grace)
            if late:
                log.warning(
                    "%d message(s) still in flight after the %gs grace period: rolling them back",
                    len(late),
                    grace,
                )
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
        for taker in self._takers:
            taker.cancel()
        await asyncio.gather(*self._takers, return_exceptions=True)
        await self.settlements.flush()  # what they wait for was never taken: it will not settle
        await self.subscription.close()  # deliveries never taken go back to the queue

    async def run(self, stop: asyncio.Event) -> None:
        """Return when ``stop`` is set; raise if consuming failed for good meanwhile (a pause
        that could not resume), so that the process does not run half-alive."""
        await first(stop.wait(), self._failure, self.gate.broken)

    def _on_message(self, message: Received) -> None:
        self.settlements.received(message)
        self._pending.append(message)
        self._arrived.set()

    async def _take(self) -> None:
        """One of ``concurrency`` takers: when free, take up to a batch of the deliveries that
        arrived (after waiting ``batch_linger`` for more if there are fewer) and handle them.

        A batch runs in a task of the worker's own, shielded: a lost broker connection never
        cancels an open transaction; it commits, its acks fail on the dead channel, and the
        broker's redeliveries are recognised as duplicates.
        """
        size, linger = self.batch_size, self.settings.batch_linger
        while True:
            await self._arrived.wait()
            if self.throttled:
                async with self._one_at_a_time:  # the takers queue up here: one at a time
                    if self.throttled:
                        await first(
                            self._stopping.wait(), within=self.settings.failure_throttle_delay
                        )
                    if self._stopping.is_set():
                        return
                    await self._run(self._next(1))
                continue
            if len(self._pending) < size and linger and not self._stopping.is_set():
                await asyncio.sleep(linger)
            if self._stopping.is_set():
                return
            await self._run(self._next(size))

    def _next(self, size: int) -> list[Received]:
        batch, self._pending[:size] = self._pending[:size], []
        if not self._pending:
            self._arrived.clear()
        return batch

    async def _run(self, batch: list[Received]) -> None:
        if not batch:
            return
        self.taken = batch
        task = asyncio.create_task(self.handle_batch(batch))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        await asyncio.shield(task)

    def _taker_ended(self, taker: asyncio.Task[None]) -> None:
        if not taker.cancelled() and taker.exception() is not None:
            log.error("a consumer task died", exc_info=taker.exception())
            if not self._failure.done():
                self._failure.set_exception(taker.exception())  # type: ignore[arg-type]

    async def handle_batch(self, messages: list[Received]) -> None:
        """Process deliveries to their end, those that can share one in one transaction.

        Those that failed their checks are parked together while the deliveries that passed
        them are processed together (``unit_of_work.process_batch``) and acked after its
        commit; then workflows run, each alone. If the
        batch fails in any way, each of its deliveries is processed again in a transaction of
        its own, so only the failing one takes the failure path.
        """
        live = [message for message in messages if not channel_closed(message)]
        if len(live) < len(messages):
            # Received before the connection was lost: the broker delivers them again, so
            # running them now would only commit effects whose acks cannot be sent.
            log.info(
                "%d delivery(ies) of a closed channel left for the broker to deliver again",
                len(messages) - len(live),
            )
            messages = live
        if self.paused:
            await self.copies.requeue_all([(m, self._handler_name(m)) for m in messages])
            return
        deliveries = [(m, delivery_from_amqp(m)) for m in messages]
        check = await checked_off_loop(deliveries, self._open)
        opened, refused = await self._in_own_key_space(check.opened)
        split = grouped(opened)
        rejected = [*check.rejected, *((m, e.delivery, exc) for m, e, exc in refused.reserved)]
        if rejected:  # (neither waits for the other: parking waits on the broker mostly)
            await _together(
                self.failures.failed_checks(rejected),
                self._process_together(split.together),
            )
        else:
            await self._process_together(split.together)
        for message, envelope, exc in refused.unanswered:
            with logs.message_context(envelope.delivery):
                await self.failures.delivery_failed(message, envelope.delivery, envelope, exc)
        for message, envelope in split.alone:  # a lone message, and workflows: each its own run
            await self._process_alone(message, envelope)

    async def _in_own_key_space(
        self, opened: list[tuple[Received, Envelope]]
    ) -> tuple[list[tuple[Received, Envelope]], _Refused]:
        """``keyspace.refused_keys``: a key of the ingress's space it did not accept is refused
        (parked with the failed checks, its key not recorded). If the database cannot tell,
        those deliveries take the failure path with its error, each alone (transient: retried
        later, or the worker pauses)."""
        try:
            kept, reserved = await keyspace.refused_keys(self.engine, opened)
        except Exception as exc:
            claimed = [(m, e, exc) for m, e in opened if keyspace.claim_of(e) is not None]
            if not claimed:
                raise
            others = [(m, e) for m, e in opened if keyspace.claim_of(e) is None]
            return others, _Refused([], claimed)
        return kept, _Refused(list(reserved), [])

    async def _process_together(self, together: list[tuple[Received, Envelope]]) -> None:
        if not together:
            return
        envelopes = [envelope for _, envelope in together]
        handlers = {envelope.handler.name for envelope in envelopes}
        try:
            crash_point(CONSUMER_BEFORE_CLAIM, len(envelopes))
            with (
                tracing.span(
                    f"{self.settings.queue} process",
                    {
                        "messaging.system": "rabbitmq",
                        "messaging.batch.message_count": len(envelopes),
                        "worker.handler": ",".join(sorted(handlers)),
                    },
                ),
                self.telemetry.transaction(handlers.pop() if len(handlers) == 1 else None),
            ):
                ends = await unit_of_work.process_batch(self.engine, envelopes, self.unit_of_work)
        except Exception as exc:
            log.info(
                "a batch of %d failed (%r); processing its messages one by one",
                len(together),
                exc,
            )
            self.telemetry.count(Count.BATCH_RETRIED_ALONE)
            for message, envelope in together:
                await self._process_alone(message, envelope)
            return
        crash_point(CONSUMER_AFTER_COMMIT, len(together))
        self.telemetry.batch(len(together))
        after = after_commit(together, ends)
        for _, envelope, outcome in after.committed:
            self._count(envelope, outcome)
        self.telemetry.count(Count.BATCHES)
        await self.settlements.ack([message for message, _, _ in after.committed])
        if after.isolated:
            log.info(
                "%d of a batch of %d failed in it and were taken out; the others committed",
                after.isolated,
                len(together),
            )
            self.telemetry.count(Count.ISOLATED, after.isolated)
        # beside the batch's successes, a delivery parked is no sign of a broken handler (no
        # slowing down for dead letters in a row)
        with self.streak.beside_successes() if after.committed else contextlib.nullcontext():
            await self.failures.failed_in_committed_batch(after.failed)
            for message, envelope in after.alone:
                await self._process_alone(message, envelope)

    def _handler_name(self, message: Received) -> str | None:
        """The name of the handler of ``message``'s routing key, if one is registered."""
        handler = self.router.find(delivery_from_amqp(message).routing_key)
        return handler.name if handler is not None else None

    def _count(self, envelope: Envelope, outcome: Outcome) -> None:
        self._succeeded()
        self.telemetry.tally.record(envelope.handler.name, outcome)
        log.debug(
            "%s key=%s handler=%s message_id=%s",
            outcome.value,
            envelope.key,
            envelope.handler.name,
            envelope.delivery.message_id,
        )

    def _open(self, delivery: Delivery) -> Envelope:
        return open_envelope(
            delivery,
            self.router,
            max_body_bytes=self.settings.max_body_bytes,
            max_depth=self.settings.max_json_depth,
            max_items=self.settings.max_json_items,
        )

    async def _process_alone(self, message: Received, envelope: Envelope) -> None:
        """One checked delivery in a unit of work of its own (a workflow's run, or one
        transaction), retried in process while it fails transiently."""
        if self.paused:  # (after a failed batch, the database may be what failed)
            await self.copies.requeue(message, envelope.handler.name)
            return
        delivery = envelope.delivery
        with logs.message_context(delivery, envelope):
            try:
                crash_point(CONSUMER_BEFORE_CLAIM)
                with (
                    tracing.span(
                        f"{delivery.routing_key} process",
                        {
                            "messaging.system": "rabbitmq",
                            "messaging.message.id": delivery.message_id,
                            "messaging.message.conversation_id": delivery.correlation_id,
                            "messaging.rabbitmq.destination.routing_key": delivery.routing_key,
                            "worker.handler": envelope.handler.name,
                            "worker.idempotency_key": envelope.key,
                            "worker.attempt": delivery.attempt,
                        },
                        parent_headers=delivery.headers,
                    ) as span,
                    self.telemetry.transaction(envelope.handler.name),
                ):
                    outcome: Outcome = await backoff.in_process(
                        self.settings.transient_attempts, log
                    )(unit_of_work.apply, self.engine, envelope, self.unit_of_work)
                    tracing.set_attribute(span, "worker.outcome", outcome.value)
            except Exception as exc:
                await self.failures.delivery_failed(message, delivery, envelope, exc)
                return
            crash_point(CONSUMER_AFTER_COMMIT)
            self.telemetry.batch(1)
            self._count(envelope, outcome)
            await self.settlements.ack_one(message)

    def _succeeded(self) -> None:
        """A message ended well: dead letters are no longer in a row, nor deployment pauses."""
        self.streak.succeeded()
        self.gate.succeeded()

    def database_unreachable(self, detail: str) -> None:
        """Pause as a unit of work that found PostgreSQL unreachable would (the health monitor's
        probe found it so, ``detail`` says how), without waiting for one: an idle worker shows
        it too, and no delivery is taken only to be returned."""
        if not self.gate.paused and not self._stopping.is_set():
            task = asyncio.create_task(self.gate.pause(PauseReason.DATABASE_UNREACHABLE, detail))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
