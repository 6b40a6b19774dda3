"""The consumer: deliveries in, units of work, acks out — an ack only ever after a commit.

Deliveries are taken in micro-batches: ``concurrency`` takers each take up to ``batch_size`` of
the deliveries that arrived (waiting ``batch_linger`` for more when there are fewer), check them
(``open_envelope``), process them in one transaction (``unit_of_work.process_batch``) and ack
them after its commit, with one multiple-ack where that is safe (``acks``). A delivery whose
handler fails in a batch is taken out of it and the others commit (``unit_of_work``); after the
commit, those that failed for good take their failure path together (``after_commit``), and the
others run alone. A batch that fails as a whole is redone one delivery per transaction. So only
a failing delivery takes the failure path, and it ends where the failure policy says
(``core.policy.decide``), carried out by ``failures.Failures``:

- transient (``errors.classify``): retried in-process ``transient_attempts`` times with
  backoff; then sent to the next delayed-retry queue with its attempt count; after the last one,
  parked in the dead-letter queue as ``retries-exhausted``;
- permanent (a ``Rejected`` check, a handler error): parked in the dead-letter queue; when it has
  a key, the key is recorded as failed so a later duplicate is acked without running again;
- PostgreSQL unreachable (whatever the error looked like): nothing is parked or retried. The
  delivery returns to the queue and consumption pauses until the database answers again;
- the deployment's fault (``errors.Fault.DEPLOYMENT``: a table, column, function or privilege
  missing): likewise nothing is parked and no key is marked failed; consumption pauses and tries
  again after a growing wait (sooner once the migrations are at head).

Nothing a message holds can raise past the checks: an unexpected error while opening it parks
it as ``check-failed``. After ``failure_throttle_after`` dead letters in a row, the consumer
takes one message at a time, ``failure_throttle_delay`` apart, until one succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractRobustConnection,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import backoff, database, logs, schema, tracing
from worker.backoff import first
from worker.core import unit_of_work
from worker.core.batches import after_commit, grouped
from worker.core.config import UnitOfWorkConfig
from worker.core.envelope import (
    ROUTING_KEY_HEADER,
    Delivery,
    Envelope,
    open_envelope,
)
from worker.core.outcomes import Outcome
from worker.core.router import Router
from worker.errors import (
    CheckFailed,
    PauseReason,
    Rejected,
)
from worker.faults import (
    CONSUMER_AFTER_COMMIT,
    CONSUMER_BEFORE_CLAIM,
    CONSUMER_DRAINING,
    crash_point,
)
from worker.ops.metrics import Metrics
from worker.settings import Settings
from worker.transport.acks import Settlements, channel_closed
from worker.transport.failures import Failures
from worker.transport.topology import Topology, declare_topology

log = logging.getLogger(__name__)

DEPLOYMENT_RETRY_MAX = 60.0
"""Longest wait, in seconds, before a consumer paused by a deployment fault tries again; the wait
doubles from 1 s with each such pause until a message succeeds."""


def delivery_from_amqp(message: AbstractIncomingMessage) -> Delivery:
    """The transport-neutral facts of an aio-pika delivery.

    A message that came through the default exchange (back from a delayed retry, or replayed
    from the DLQ) is routed by the routing key it was first published with.
    """
    headers = dict(message.headers or {})
    routing_key = message.routing_key or ""
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
        exchange=message.exchange or "",
        redelivered=bool(message.redelivered),
    )


class Consumer:
    """Consumes the work queue on one channel, ``concurrency`` transactions at a time.

    ``stats`` (``metrics.tally.stats``: given both, ``metrics`` must be ``Metrics(stats)``) counts
    outcomes, each once (``Tally.record``): ``processed``, ``duplicate``, ``duplicate_of_failed``,
    ``retry_scheduled``, ``dead_lettered``, ``dead_lettered:<reason>``, ``requeued``,
    ``rejected_to_broker`` (a DLQ copy that could not be published, dead-lettered by the broker
    instead), ``paused`` (times consumption paused for a database outage or a deployment fault) and
    ``throttled`` (times it slowed down after consecutive dead letters); and for batches:
    ``batches`` (transactions of several deliveries), ``multiple_acks``, ``isolated`` (deliveries
    whose handler failed in a batch, taken out of it to run on their own while the rest committed)
    and ``batch_retried_alone`` (batches that failed as a whole and were redone one message per
    transaction).
    """

    def __init__(
        self,
        settings: Settings,
        router: Router,
        engine: AsyncEngine,
        connection: AbstractRobustConnection,
        stats: Counter[str] | None = None,
        on_events: Callable[[], None] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = Metrics(stats) if metrics is None else metrics
        if stats is not None and stats is not self.metrics.tally.stats:
            raise ValueError("count into one place: pass Metrics(stats), or stats alone")
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
        self.stats: Counter[str] = self.metrics.tally.stats
        self.settlements = Settlements(hold=self.ack_hold, stats=self.stats)
        self._pending: list[AbstractIncomingMessage] = []
        self._arrived = asyncio.Event()
        self._takers: list[asyncio.Task[None]] = []
        self._in_flight: set[asyncio.Task[None]] = set()
        self._channel: AbstractChannel | None = None
        self._topology: Topology | None = None
        self._consumer_tag: str | None = None
        self._stopping = asyncio.Event()
        self._resuming: asyncio.Task[None] | None = None
        self._pause_reason: PauseReason | None = None
        self._pause_detail = ""
        self._deployment_pauses = 0
        self._pausing = asyncio.Lock()
        self._one_at_a_time = asyncio.Lock()
        self.failures = Failures(
            settings,
            router,
            engine,
            self.settlements,
            self.metrics,
            channel=lambda: self._channel,
            topology=lambda: self._topology,
            pause=self._pause,
        )
        self._failure: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def consuming(self) -> bool:
        """True while a consumer is attached to the work queue on an open channel."""
        channel = self._channel
        return self._consumer_tag is not None and channel is not None and not channel.is_closed

    @property
    def paused(self) -> bool:
        """True while consumption waits for PostgreSQL to answer again, or for a deployment
        fault to be fixed."""
        return self._resuming is not None

    @property
    def throttled(self) -> bool:
        """True while dead letters in a row hold the consumer to one message at a time."""
        return self.failures.throttled

    def condition(self) -> dict[str, object]:
        """What ``/healthz`` shows of the consumer beyond ``consuming``: why it is paused, if it
        is, and whether it is throttled."""
        state: dict[str, object] = {"throttled": self.throttled}
        if self._pause_reason is not None:
            state["paused"] = self._pause_reason.value
            state["paused_because"] = self._pause_detail
        return state

    async def start(self) -> Topology:
        """Declare the topology and start consuming."""
        self._channel = await self.connection.channel(
            publisher_confirms=True, on_return_raises=True
        )
        await self._channel.set_qos(prefetch_count=self.settings.prefetch)
        self._topology = await declare_topology(
            self._channel, self.settings, self.router.routing_keys()
        )
        for _ in range(self.settings.concurrency):
            taker = asyncio.create_task(self._take())
            taker.add_done_callback(self._taker_ended)
            self._takers.append(taker)
        await self._consume()
        log.info(
            "consuming queue %r (routing keys: %s; prefetch %d, concurrency %d, batch size %d)",
            self.settings.queue,
            ", ".join(self.router.routing_keys()) or "none",
            self.settings.prefetch,
            self.settings.concurrency,
            self.batch_size,
        )
        return self._topology

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
        if self._resuming is not None:
            await asyncio.gather(self._resuming, return_exceptions=True)
        await self._cancel()
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
        if self._channel is not None and not self._channel.is_closed:
            await self._channel.close()  # deliveries never taken go back to the queue

    async def run(self, stop: asyncio.Event) -> None:
        """Return when ``stop`` is set; raise if consuming failed for good meanwhile (a pause
        that could not resume), so that the process does not run half-alive."""
        await first(stop.wait(), self._failure)

    async def _consume(self) -> None:
        assert self._topology is not None
        self._consumer_tag = await self._topology.queue.consume(self._on_message)

    async def _cancel(self) -> None:
        if self._topology is not None and self._consumer_tag is not None:
            tag, self._consumer_tag = self._consumer_tag, None
            try:
                await self._topology.queue.cancel(tag)
            except Exception:  # a dead channel consumes nothing anyway
                log.debug("cancelling the consumer failed", exc_info=True)

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
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

    def _next(self, size: int) -> list[AbstractIncomingMessage]:
        batch, self._pending[:size] = self._pending[:size], []
        if not self._pending:
            self._arrived.clear()
        return batch

    async def _run(self, batch: list[AbstractIncomingMessage]) -> None:
        if not batch:
            return
        task = asyncio.create_task(self.handle_batch(batch))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        await asyncio.shield(task)

    def _taker_ended(self, taker: asyncio.Task[None]) -> None:
        if not taker.cancelled() and taker.exception() is not None:
            log.error("a consumer task died", exc_info=taker.exception())
            if not self._failure.done():
                self._failure.set_exception(taker.exception())  # type: ignore[arg-type]

    async def handle_batch(self, messages: list[AbstractIncomingMessage]) -> None:
        """Process deliveries to their end, those that can share one in one transaction.

        The deliveries that pass their checks are processed together
        (``unit_of_work.process_batch``) and acked after its commit; then those that failed
        their checks are parked, and workflows run, each alone. If the
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
            await self.failures.requeue_all([(m, self._handler_name(m)) for m in messages])
            return
        opened: list[tuple[AbstractIncomingMessage, Envelope]] = []
        rejected: list[tuple[AbstractIncomingMessage, Delivery, Rejected]] = []
        for message in messages:
            delivery = delivery_from_amqp(message)
            try:
                envelope = self._open(delivery)
            except Rejected as exc:
                rejected.append((message, delivery, exc))
                continue
            except Exception as exc:  # whatever the body holds, it never kills the consumer
                failed = CheckFailed(f"{type(exc).__name__}: {exc}")
                failed.__cause__ = exc
                rejected.append((message, delivery, failed))
                continue
            opened.append((message, envelope))
        split = grouped(opened)
        if split.together:
            await self._process_together(split.together)
        for message, delivery, rejection in rejected:
            with logs.message_context(delivery):
                await self.failures.failed(message, delivery, None, rejection)
        for message, envelope in split.alone:  # a lone message, and workflows: each its own run
            await self._process_alone(message, envelope)

    async def _process_together(
        self, together: list[tuple[AbstractIncomingMessage, Envelope]]
    ) -> None:
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
                self.metrics.transaction(handlers.pop() if len(handlers) == 1 else None),
            ):
                ends = await unit_of_work.process_batch(self.engine, envelopes, self.unit_of_work)
        except Exception as exc:
            log.info(
                "a batch of %d failed (%r); processing its messages one by one",
                len(together),
                exc,
            )
            self.stats["batch_retried_alone"] += 1
            for message, envelope in together:
                await self._process_alone(message, envelope)
            return
        crash_point(CONSUMER_AFTER_COMMIT, len(together))
        self.metrics.batch(len(together))
        after = after_commit(together, ends)
        for _, envelope, outcome in after.committed:
            self._count(envelope, outcome)
        self.stats["batches"] += 1
        await self.settlements.ack([message for message, _, _ in after.committed])
        if after.isolated:
            log.info(
                "%d of a batch of %d failed in it and were taken out; the others committed",
                after.isolated,
                len(together),
            )
            self.stats["isolated"] += after.isolated
        # beside the batch's successes, a delivery parked is no sign of a broken handler (no
        # slowing down for dead letters in a row)
        with self.failures.beside_successes() if after.committed else contextlib.nullcontext():
            await self.failures.failed_in_committed_batch(after.failed)
            for message, envelope in after.alone:
                await self._process_alone(message, envelope)

    def _handler_name(self, message: AbstractIncomingMessage) -> str | None:
        """The name of the handler of ``message``'s routing key, if one is registered."""
        handler = self.router.find(delivery_from_amqp(message).routing_key)
        return handler.name if handler is not None else None

    def _count(self, envelope: Envelope, outcome: Outcome) -> None:
        self._succeeded()
        self.metrics.tally.record(envelope.handler.name, outcome)
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
        )

    async def _process_alone(self, message: AbstractIncomingMessage, envelope: Envelope) -> None:
        """One checked delivery in a unit of work of its own (a workflow's run, or one
        transaction), retried in process while it fails transiently."""
        if self.paused:  # (after a failed batch, the database may be what failed)
            await self.failures.requeue(message, envelope.handler.name)
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
                    self.metrics.transaction(envelope.handler.name),
                ):
                    outcome: Outcome = await backoff.in_process(
                        self.settings.transient_attempts, log
                    )(unit_of_work.apply, self.engine, envelope, self.unit_of_work)
                    tracing.set_attribute(span, "worker.outcome", outcome.value)
            except Exception as exc:
                await self.failures.failed(message, delivery, envelope, exc)
                return
            crash_point(CONSUMER_AFTER_COMMIT)
            self.metrics.batch(1)
            self._count(envelope, outcome)
            await self.settlements.ack_one(message)

    def _succeeded(self) -> None:
        """A message ended well: dead letters are no longer in a row, nor deployment pauses."""
        self.failures.succeeded()
        self._deployment_pauses = 0

    def database_unreachable(self, detail: str) -> None:
        """Pause as a unit of work that found PostgreSQL unreachable would (the health monitor's
        probe found it so, ``detail`` says how), without waiting for one: an idle worker shows
        it too, and no delivery is taken only to be returned."""
        if self._resuming is None and not self._stopping.is_set():
            task = asyncio.create_task(self._pause(PauseReason.DATABASE_UNREACHABLE, detail))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _pause(self, reason: PauseReason, detail: str) -> None:
        """Stop consuming until the fault is gone; return once the broker confirmed it.

        Deliveries are returned to the queue only after that, so none comes back to this
        consumer while it is paused (aiormq silently drops a delivery for a cancelled consumer,
        which would leave it unacknowledged until the channel closes).
        """
        async with self._pausing:
            if self._resuming is not None or self._stopping.is_set():
                return
            await self._cancel()
            self.stats["paused"] += 1
            self._pause_reason, self._pause_detail = reason, detail
            self.metrics.paused(reason)
            if reason is PauseReason.DEPLOYMENT:
                self._deployment_pauses += 1
                wait = min(DEPLOYMENT_RETRY_MAX, 2 ** (self._deployment_pauses - 1))
                log.error(
                    "the deployment does not match the code (%s): consumption paused, nothing "
                    "parked; trying again in %gs, or once migrations are at head. Apply the "
                    "migrations (`worker migrate`) or grant the privileges.",
                    detail,
                    wait,
                )
                self._resuming = asyncio.create_task(self._resume_after_deployment_fault(wait))
            else:
                log.error("%s: consumption paused until it answers again", detail)
                self._resuming = asyncio.create_task(self._resume_when_database_answers())

    async def _resume_after_deployment_fault(self, wait: float) -> None:
        """Resume after ``wait`` seconds, or sooner once migrations that were pending are
        applied (a missing privilege shows only by trying: the next message tries), declaring
        the topology again first (a deleted queue comes back)."""

        async def fixed() -> None:
            if not await self._schema_behind():
                await asyncio.sleep(wait)
                return
            behind = True
            async with asyncio.timeout(wait):
                while behind:
                    await asyncio.sleep(min(wait, 1.0))
                    behind = await self._schema_behind()

        await self._resume(fixed, "trying the deployment again", redeclare=True)

    async def _schema_behind(self) -> bool:
        try:
            return bool(await schema.pending(self.engine, self.settings, self.router))
        except Exception:  # an unreadable schema is no reason to wait less or more
            log.debug("could not read the migration state", exc_info=True)
            return False

    async def _resume_when_database_answers(self) -> None:
        async def answers() -> None:
            await backoff.until_stopped(self._stopping, initial=0.5, maximum=5.0, logger=log)(
                database.probe, self.engine
            )

        await self._resume(answers, "PostgreSQL answers again")

    async def _resume(
        self, fixed: Callable[[], Awaitable[None]], why: str, *, redeclare: bool = False
    ) -> None:
        """Wait until ``fixed`` returns (or the worker stops), then consume again; with
        ``redeclare``, declare the topology first. A declaration in flight is never cancelled
        (that would close the channel the deliveries in flight still ack on)."""
        try:
            with contextlib.suppress(TimeoutError):
                await first(fixed(), self._stopping.wait())
            if redeclare and self._channel is not None and not self._stopping.is_set():
                self._topology = await backoff.until_stopped(self._stopping, logger=log)(
                    declare_topology, self._channel, self.settings, self.router.routing_keys()
                )
            if not self._stopping.is_set():
                await backoff.until_stopped(self._stopping, logger=log)(self._consume)
                log.info("%s: consumption resumed", why)
        except Exception as exc:
            if not self._stopping.is_set():
                log.exception("could not resume consuming")
                if not self._failure.done():
                    self._failure.set_exception(exc)
        finally:
            self._resuming = None
            self._pause_reason, self._pause_detail = None, ""
            self.metrics.paused(None)
