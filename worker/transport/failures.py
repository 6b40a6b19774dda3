"""Failure routing: carry out the failure policy's decision for a delivery that failed.

``core.policy.decide`` says where a failure goes; this module only does it, on the consumer's
channel: a delayed-retry copy, a dead-letter copy (and the key recorded as failed), the delivery
back to the queue while consumption pauses, or, when a copy cannot be published, the broker's own
dead-lettering. Every delivery it is given ends in exactly one of them, counted once in the
``Tally``.

Invariant: the delivery is acked only after the broker confirmed the copy it was turned into,
and parking always ends: once the DLQ copy is confirmed the delivery is acked, even if recording
its key as failed does not work (the copy is the record). Each DLQ copy's parking record (its
provenance, ``worker.sql.parkings``) is committed before the copy is published; if the database
cannot take it, nothing is parked: the deliveries return to the queue and consumption pauses, as
for any fault of the database. A key is recorded as failed only after
its copy was confirmed, so a recorded failure always has a parked copy. If the copy cannot be
published while the channel lives, the delivery is handed to the broker's own dead-lettering
(``reject``) instead of returning to the queue; a copy lost with its channel returns it to the
queue once. After ``failure_throttle_after`` dead letters in a row, ``throttled`` holds the
consumer to one message at a time until one succeeds.

The deliveries that failed in one batch (``failed_in_committed_batch``) are parked together: their
copies published at once and their confirms awaited together, their keys recorded as failed in one
transaction, then their acks; a crash between two of these steps leaves them as a crash would
leave one delivery between the same steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import backoff, database, logs
from worker.core.envelope import IDEMPOTENCY_KEY_HEADER, Delivery, Envelope
from worker.core.outcomes import Outcome
from worker.core.policy import (
    Decision,
    FailureFacts,
    Park,
    Pause,
    PolicySettings,
    RetryLater,
    RetryQueue,
    asks_database,
    decide,
)
from worker.core.router import Router
from worker.errors import Fault, PauseReason, Reason, classify
from worker.faults import FAILURES_PARKED, FAILURES_RECORDED, crash_point
from worker.ops.metrics import Metrics
from worker.settings import Settings, format_duration
from worker.sql import inbox
from worker.sql.parkings import ParkingRow, record_parkings
from worker.transport import dead_letters
from worker.transport.acks import Settlements
from worker.transport.dead_letters import Failure
from worker.transport.topology import Topology

log = logging.getLogger("worker.transport.consumer")  # the consumer's log lines, as they were

LOST_COPIES_REMEMBERED = 10_000
"""Deliveries whose failure copy was lost with the channel, remembered to break a cycle."""

Pauser = Callable[[PauseReason, str], Awaitable[None]]
"""Pauses consumption for a reason (with a detail for the log); returns once it is paused."""

Publish = Callable[[AbstractExchange], Awaitable[None]]
"""Publishes the copy a failure turns a delivery into, given the default exchange; returns after
the broker's confirm."""


@dataclass(frozen=True)
class _Failed:
    """A failed delivery on its way to where the policy sends it (``envelope`` None when it
    failed its checks)."""

    message: AbstractIncomingMessage
    envelope: Envelope | None
    failure: Failure

    def logged(self) -> contextlib.AbstractContextManager[None]:
        """Tag the records logged inside with the delivery's identity."""
        return logs.message_context(self.failure.delivery, self.envelope)


@dataclass(frozen=True)
class _Copy:
    """The copy ``failed`` is turned into, for ``reason``, sent by ``publish``."""

    failed: _Failed
    reason: Reason
    publish: Publish


@dataclass(frozen=True)
class _Parking:
    """A failed delivery the policy parks (``park``)."""

    failed: _Failed
    park: Park


async def _confirmed(publishes: Iterable[Awaitable[object]]) -> list[Exception | None]:
    """Await ``publishes`` all at once: for each, None once the broker confirmed it, else the
    error that kept it from being confirmed. A cancellation is raised: the shutdown's grace
    period is over."""
    outcomes = await asyncio.gather(*publishes, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome
    return [outcome if isinstance(outcome, Exception) else None for outcome in outcomes]


def _identity(message: AbstractIncomingMessage) -> tuple[object, ...]:
    """What tells one message from another across its redeliveries (tags change)."""
    headers = message.headers or {}
    return (
        message.message_id,
        message.routing_key,
        str(headers.get(IDEMPOTENCY_KEY_HEADER)),
        len(message.body),
        hash(message.body),
    )


def _parked_copy(
    dead_letter_exchange: AbstractExchange, parking: _Parking, record: ParkingRow
) -> _Copy:
    """The copy ``parking`` parks in the dead-letter queue through ``dead_letter_exchange``, as
    ``record`` says."""
    failed, reason = parking.failed, parking.park.reason

    async def publish(_: AbstractExchange) -> None:
        await dead_letters.park(dead_letter_exchange, failed.message, failed.failure, record)

    return _Copy(failed, reason, publish)


def _records_key(parking: _Parking) -> bool:
    """True when ``parking`` records its delivery's key as failed in the inbox."""
    return parking.failed.envelope is not None and parking.park.record_key


class Failures:
    """Routes the failed deliveries of one consumer (see the module docstring).

    ``channel`` and ``topology`` return the consumer's current ones (a paused consumer declares
    the topology again); ``pause`` is the consumer's own.
    """

    def __init__(
        self,
        settings: Settings,
        router: Router,
        engine: AsyncEngine,
        settlements: Settlements,
        metrics: Metrics,
        *,
        channel: Callable[[], AbstractChannel | None],
        topology: Callable[[], Topology | None],
        pause: Pauser,
    ) -> None:
        self.settings = settings
        self.policy = PolicySettings.of(settings)
        self.router = router
        self.engine = engine
        self.settlements = settlements
        self.metrics = metrics
        self.tally = metrics.tally
        self._channel = channel
        self._topology = topology
        self._pause = pause
        self._unreachable_because = "PostgreSQL unreachable"
        """What the last probe that failed said, for a pause's reason."""
        self._dead_letters_in_a_row = 0
        self._beside_successes = 0
        self._copies_lost: OrderedDict[tuple[object, ...], None] = OrderedDict()

    @property
    def throttled(self) -> bool:
        """True while dead letters in a row hold the consumer to one message at a time."""
        limit = self.settings.failure_throttle_after
        return limit > 0 and self._dead_letters_in_a_row >= limit

    def succeeded(self) -> None:
        """A message ended well: dead letters are no longer in a row."""
        if self.throttled:
            self.metrics.throttled(False)
            log.warning("a message succeeded: back to full speed")
        self._dead_letters_in_a_row = 0

    @contextlib.contextmanager
    def beside_successes(self) -> Iterator[None]:
        """Dead letters inside are not in a row: they were taken out of a batch whose other
        messages just committed, so the handler works and this is no reason to slow down."""
        self._beside_successes += 1
        try:
            yield
        finally:
            self._beside_successes -= 1

    async def failed(
        self,
        message: AbstractIncomingMessage,
        delivery: Delivery,
        envelope: Envelope | None,
        exc: Exception,
    ) -> None:
        """Carry out the policy's decision for ``message``, which failed with ``exc`` after its
        in-process tries (``envelope`` is None when it failed its checks)."""
        facts = FailureFacts.of(delivery, self.policy, opened=envelope is not None)
        if asks_database(facts):
            facts = replace(facts, database_answers=await self._database_answers())
        failed = self._failed(message, delivery, envelope, exc)
        decision = decide(exc, facts, self.policy)
        if isinstance(decision, Park):
            await self._park([self._parking(failed, decision, exc)])
        else:
            await self._carry_out(failed, decision, exc)

    async def failed_in_committed_batch(
        self, failures: Sequence[tuple[AbstractIncomingMessage, Envelope, Exception]]
    ) -> None:
        """Carry out the policy's decision for each (delivery, envelope, error) of a batch whose
        transaction committed after they failed in it, each failed for good (``KeyReused``, or
        a culprit whose error ``classify`` calls permanent), with distinct keys.

        PostgreSQL answered after these failures (it committed), so it is not probed again; the
        deliveries the policy parks are parked together (``_park``), any other goes its way on
        its own.
        """
        parkings: list[_Parking] = []
        for message, envelope, exc in failures:
            delivery = envelope.delivery
            facts = FailureFacts.of(delivery, self.policy, opened=True, database_answers=True)
            failed = self._failed(message, delivery, envelope, exc)
            decision = decide(exc, facts, self.policy)
            if isinstance(decision, Park):
                parkings.append(self._parking(failed, decision, exc))
            else:
                with failed.logged():
                    await self._carry_out(failed, decision, exc)
        await self._park(parkings)

    def _failed(
        self,
        message: AbstractIncomingMessage,
        delivery: Delivery,
        envelope: Envelope | None,
        exc: Exception,
    ) -> _Failed:
        handler = (
            envelope.handler if envelope is not None else self.router.find(delivery.routing_key)
        )
        return _Failed(message, envelope, Failure.of(delivery, exc, handler))

    @staticmethod
    def _parking(failed: _Failed, park: Park, exc: Exception) -> _Parking:
        if park.unexpected:
            with failed.logged():
                log.error(
                    "unexpected failure for message %s", failed.message.message_id, exc_info=exc
                )
        return _Parking(failed, park)

    async def _carry_out(self, failed: _Failed, decision: Decision, exc: Exception) -> None:
        """Carry out a decision that parks nothing: a pause, or a delayed retry."""
        if isinstance(decision, Pause):
            detail = (
                self._unreachable_because
                if decision.reason is PauseReason.DATABASE_UNREACHABLE
                else logs.describe_error(exc)
            )
            await self._pause(decision.reason, detail)
            await self.requeue(failed.message, failed.failure.handler)
        elif isinstance(decision, RetryLater):
            await self._retry_later(failed, decision.queue)
        else:  # RetryInProcess: the facts say the in-process tries are spent
            raise AssertionError(
                f"{decision} after the in-process tries of {failed.failure.delivery.message_id}"
            )

    async def requeue(self, message: AbstractIncomingMessage, handler: str | None) -> None:
        """Return ``message`` to the queue untouched (a fault that is not the message's)."""
        await self.requeue_all([(message, handler)])

    async def requeue_all(
        self, returned: Sequence[tuple[AbstractIncomingMessage, str | None]]
    ) -> None:
        """Return each delivery (with its handler's name, for the tally) to the queue untouched.

        A quorum queue with a delivery limit counts a return as a failed delivery: pauses
        repeated often enough (a deployment fault tried again for an hour) would have the broker
        dead-letter messages that did nothing wrong. There each goes back as a copy at the
        queue's tail (its count starts again): the copies are published at once, and each
        original is acked once the broker confirmed its copy; one whose copy failed is returned
        as it is.
        """
        for _, handler in returned:
            self.tally.record(handler, Outcome.REQUEUED)
        messages = [message for message, _ in returned]
        topology = self._topology()
        copied = [False] * len(messages)
        if self._returns_count and topology is not None:
            errors = await _confirmed(
                topology.default_exchange.publish(
                    dead_letters.moved_copy(message),
                    routing_key=self.settings.queue,
                    mandatory=True,
                )
                for message in messages
            )
            for message, error in zip(messages, errors, strict=True):
                if error is not None:
                    log.debug("could not return %s as a copy: %r", message.message_id, error)
            copied = [error is None for error in errors]
            await self.settlements.ack(
                [m for m, done in zip(messages, copied, strict=True) if done]
            )
        for message, done in zip(messages, copied, strict=True):
            if not done:
                await self.settlements.requeue(message)

    @property
    def _returns_count(self) -> bool:
        """Whether the broker counts a returned delivery toward a delivery limit."""
        return self.settings.work_queue_delivery_limit > 0

    async def _retry_later(self, failed: _Failed, queue: RetryQueue) -> None:
        message, failure = failed.message, failed.failure

        async def publish(default_exchange: AbstractExchange) -> None:
            await dead_letters.schedule_retry(
                default_exchange, message, failure, retry_queue=queue.name
            )

        [copied] = await self._copies([_Copy(failed, Reason.RETRY_FAILED, publish)])
        if not copied:
            return
        self.tally.record(failure.handler, Outcome.RETRY_SCHEDULED)
        log.warning(
            "attempt %d of message %s failed transiently; retrying in %gs: %s",
            failure.attempts,
            message.message_id,
            queue.delay,
            failure.error,
        )
        await self.settlements.ack_one(message)

    async def _park(self, parkings: Sequence[_Parking]) -> None:
        """Park each in the DLQ; then record the keys the policy says as failed, all in one
        transaction; then ack them.

        Parking comes first: a crash before the acks parks a delivery twice at worst, while a
        recorded failure without a parked copy would leave nothing to replay. The copies are
        published at once and their confirms awaited together; a delivery whose copy was not
        confirmed was settled otherwise (``_copies``) and is neither recorded nor acked here.
        Once the broker confirmed a copy, its delivery is acked whatever happens to the record
        (the copy is the record).
        """
        if not parkings:
            return
        topology = self._topology()
        assert topology is not None
        records = [
            p.failed.failure.parking(p.park.reason, failed_key=_records_key(p)) for p in parkings
        ]
        if not await self._record_parkings(parkings, records):
            return
        copied = await self._copies(
            [
                _parked_copy(topology.dead_letter_exchange, parking, record)
                for parking, record in zip(parkings, records, strict=True)
            ]
        )
        parked = [parking for parking, ok in zip(parkings, copied, strict=True) if ok]
        if not parked:
            return
        crash_point(FAILURES_PARKED, len(parked))
        await self._record_failures([p.failed for p in parked if _records_key(p)])
        crash_point(FAILURES_RECORDED, len(parked))
        for parking in parked:
            failure = parking.failed.failure
            self._count_dead_letter(failure, parking.park.reason)
            with parking.failed.logged():
                log.warning(
                    "dead-lettered message %s (routing key %r): %s: %s",
                    parking.failed.message.message_id,
                    failure.delivery.routing_key,
                    parking.park.reason,
                    failure.error,
                )
        await self.settlements.ack([parking.failed.message for parking in parked])

    async def _record_parkings(
        self, parkings: Sequence[_Parking], records: Sequence[ParkingRow]
    ) -> bool:
        """Commit ``records`` (the provenance of the copies about to be parked), tried again in
        process while it fails transiently; False when it could not be: then nothing is parked,
        consumption pauses and the deliveries return to the queue."""
        try:
            await backoff.in_process(self.settings.transient_attempts, log)(
                self._record_parkings_in_one_transaction, records
            )
        except Exception as exc:
            fault = classify(exc)
            if fault is Fault.PERMANENT:  # a bug, not a message's nor a deployment's fault
                log.error("parking without a record (replay will need --force)", exc_info=exc)
                return True
            reason = (
                PauseReason.DATABASE_UNREACHABLE
                if fault is Fault.TRANSIENT
                else PauseReason.DEPLOYMENT
            )
            await self._pause(
                reason, f"cannot record a dead-letter parking: {logs.describe_error(exc)}"
            )
            await self.requeue_all([(p.failed.message, p.failed.failure.handler) for p in parkings])
            return False
        return True

    async def _record_parkings_in_one_transaction(self, records: Sequence[ParkingRow]) -> None:
        async with self.engine.begin() as conn:
            await record_parkings(conn, records)

    async def _copies(self, copies: Sequence[_Copy]) -> list[bool]:
        """Publish the copies failures turn deliveries into, at once; for each, True once the
        broker confirmed it, else its delivery is settled here.

        A failed copy never sends the delivery round and round. An unroutable copy (its queue
        was deleted) is the deployment's fault: consumption pauses, and declares the topology
        again before it resumes. If the broker refused the copy otherwise while the channel
        lives (nacked, or the client could not encode it), or if the delivery comes back redelivered
        after its copy cost the channel before (a copy over the broker's size limit closes it),
        the broker's own dead-lettering parks the original as it is (``reject``). Only a copy
        lost with its channel returns the delivery to the queue, once.
        """
        topology = self._topology()
        assert topology is not None
        confirmed = [False] * len(copies)
        sending: list[int] = []
        for index, copy in enumerate(copies):
            message = copy.failed.message
            identity = _identity(message)
            if message.redelivered and identity in self._copies_lost:
                del self._copies_lost[identity]
                with copy.failed.logged():
                    log.error(
                        "message %s came back after its %s copy was lost with the channel; the "
                        "broker dead-letters it as it is",
                        message.message_id,
                        copy.reason,
                    )
                    await self._reject_to_broker(message, copy.failed.failure, copy.reason)
            else:
                sending.append(index)
        errors = await _confirmed(
            copies[index].publish(topology.default_exchange) for index in sending
        )
        for index, error in zip(sending, errors, strict=True):
            if error is None:
                confirmed[index] = True
            else:
                with copies[index].failed.logged():
                    await self._copy_failed(copies[index], error)
        return confirmed

    async def _copy_failed(self, copy: _Copy, exc: Exception) -> None:
        """Settle the delivery whose copy ``exc`` kept from being confirmed (see ``_copies``)."""
        message, failure, reason = copy.failed.message, copy.failed.failure, copy.reason
        if isinstance(exc, aiormq.exceptions.PublishError):  # returned: no queue bound
            await self._pause(
                PauseReason.DEPLOYMENT,
                f"the {reason} copy of a message is unroutable: {exc} (queue deleted?)",
            )
            await self.requeue(message, failure.handler)
            return
        if self._channel_lost(exc):
            log.warning("the copy of message %s was lost: %r", message.message_id, exc)
            self._copies_lost[_identity(message)] = None
            while len(self._copies_lost) > LOST_COPIES_REMEMBERED:
                self._copies_lost.popitem(last=False)
            await self.requeue(message, failure.handler)  # (void: the broker redelivers)
            return
        log.error(
            "the broker refused the %s copy of message %s; it dead-letters it as it is",
            reason,
            message.message_id,
            exc_info=exc,
        )
        await self._reject_to_broker(message, failure, reason)

    async def _reject_to_broker(
        self, message: AbstractIncomingMessage, failure: Failure, reason: Reason
    ) -> None:
        """Let the work queue's dead-letter exchange park ``message`` as it is (``x-death``)."""
        self.tally.stats["rejected_to_broker"] += 1
        self._count_dead_letter(failure, reason)
        await self.settlements.reject(message)

    def _count_dead_letter(self, failure: Failure, reason: Reason) -> None:
        self._dead_lettered()
        self.tally.record(failure.handler, Outcome.DEAD_LETTERED, reason)

    def _channel_lost(self, exc: BaseException) -> bool:
        """True when a publish failed because the channel or connection went away (the
        delivery's tag is void then), not because the broker refused this message."""
        channel = self._channel()
        return channel is None or channel.is_closed or classify(exc) is Fault.TRANSIENT

    def _dead_lettered(self) -> None:
        """Count one more dead letter in a row; slow down when there are too many."""
        if self._beside_successes:
            return
        self._dead_letters_in_a_row += 1
        if self._dead_letters_in_a_row == self.settings.failure_throttle_after:
            self.tally.stats["throttled"] += 1
            self.metrics.throttled(True)
            log.error(
                "%d messages in a row were dead-lettered: taking one message at a time, %s "
                "apart, until one succeeds (a handler bug or a bad deployment? see the DLQ)",
                self._dead_letters_in_a_row,
                format_duration(self.settings.failure_throttle_delay),
            )

    async def _record_failures(self, parked: Sequence[_Failed]) -> None:
        """Record the keys of ``parked`` (each with an envelope) as failed, in one transaction
        tried again in process while it fails transiently; if it cannot be, say so and go on
        (their copies are parked: a redelivery of such a key runs again)."""
        if not parked:
            return
        try:
            await backoff.in_process(self.settings.transient_attempts, log)(
                self._record_in_one_transaction, parked
            )
        except Exception as exc:
            for failed in parked:
                with failed.logged():
                    log.error(
                        "message %s is parked, but its key could not be recorded as failed; a "
                        "redelivery of the key will run again",
                        failed.message.message_id,
                        exc_info=exc,
                    )

    async def _record_in_one_transaction(self, parked: Sequence[_Failed]) -> None:
        async with self.engine.begin() as conn:
            await inbox.record_failures(
                conn,
                [
                    (failed.envelope.claim, failed.failure.error, failed.failure.attempts)
                    for failed in parked
                    if failed.envelope is not None
                ],
            )

    async def _database_answers(self) -> bool:
        try:
            await database.probe(self.engine)
        except Exception as exc:
            log.warning("PostgreSQL does not answer: %r", exc)
            self._unreachable_because = database.unreachable(exc)
            return False
        return True
