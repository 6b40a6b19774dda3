"""Failure routing: carry out the failure policy's decision for a delivery that failed.

``core.policy.decide`` says where a failure goes; this module only does it, on the consumer's
channel: a delayed-retry copy, a dead-letter copy (and the key recorded as failed), the delivery
back to the queue while consumption pauses, or, when a copy cannot be published, the broker's own
dead-lettering. Every delivery it is given ends in exactly one of them, counted once in the
``Tally``.

Invariant: the delivery is acked only after the broker confirmed the copy it was turned into,
and parking always ends: once the DLQ copy is confirmed the delivery is acked, even if recording
its key as failed does not work (the copy is the record). If the copy cannot be published while
the channel lives, the delivery is handed to the broker's own dead-lettering (``reject``) instead
of returning to the queue; a copy lost with its channel returns it to the queue once. After
``failure_throttle_after`` dead letters in a row, ``throttled`` holds the consumer to one message
at a time until one succeeds.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace

import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import backoff, database, logs
from worker.core.envelope import IDEMPOTENCY_KEY_HEADER, Delivery, Envelope
from worker.core.outcomes import Outcome
from worker.core.policy import (
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
from worker.ops.metrics import Metrics
from worker.settings import Settings, format_duration
from worker.sql import inbox
from worker.transport import dead_letters
from worker.transport.acks import Settlements
from worker.transport.dead_letters import Failure
from worker.transport.topology import Topology

log = logging.getLogger("worker.transport.consumer")  # the consumer's log lines, as they were

LOST_COPIES_REMEMBERED = 10_000
"""Deliveries whose failure copy was lost with the channel, remembered to break a cycle."""

Pauser = Callable[[PauseReason, str], Awaitable[None]]
"""Pauses consumption for a reason (with a detail for the log); returns once it is paused."""


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
        handler = (
            envelope.handler if envelope is not None else self.router.find(delivery.routing_key)
        )
        failure = Failure.of(delivery, exc, handler)
        facts = FailureFacts.of(delivery, self.policy, opened=envelope is not None)
        if asks_database(facts):
            facts = replace(facts, database_answers=await self._database_answers())
        decision = decide(exc, facts, self.policy)
        if isinstance(decision, Pause):
            detail = (
                "PostgreSQL does not answer"
                if decision.reason is PauseReason.DATABASE_UNREACHABLE
                else logs.describe_error(exc)
            )
            await self._pause(decision.reason, detail)
            await self.requeue(message, failure.handler)
        elif isinstance(decision, RetryLater):
            await self._retry_later(message, failure, decision.queue)
        elif isinstance(decision, Park):
            if decision.unexpected:
                log.error("unexpected failure for message %s", delivery.message_id, exc_info=exc)
            await self._park(message, failure, decision, envelope)
        else:  # RetryInProcess: the facts say the in-process tries are spent
            raise AssertionError(f"{decision} after the in-process tries of {delivery.message_id}")

    async def requeue(self, message: AbstractIncomingMessage, handler: str | None) -> None:
        """Return ``message`` to the queue untouched (a fault that is not the message's)."""
        self.tally.record(handler, Outcome.REQUEUED)
        await self.settlements.requeue(message)

    async def _retry_later(
        self, message: AbstractIncomingMessage, failure: Failure, queue: RetryQueue
    ) -> None:
        copied = await self._copy(
            message,
            failure,
            Reason.RETRY_FAILED,
            lambda exchange: dead_letters.schedule_retry(
                exchange, message, failure, retry_queue=queue.name
            ),
        )
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

    async def _park(
        self,
        message: AbstractIncomingMessage,
        failure: Failure,
        park: Park,
        envelope: Envelope | None,
    ) -> None:
        """Park in the DLQ; then, when the policy says so, record its key as failed; then ack.

        Parking comes first: a crash before the ack parks the message twice at worst, while a
        recorded failure without a parked copy would leave nothing to replay. Once the broker
        confirmed the copy, the delivery is acked whatever happens to the record (the copy is
        the record).
        """
        topology = self._topology()
        assert topology is not None
        dead_letter_exchange = topology.dead_letter_exchange
        reason = park.reason
        copied = await self._copy(
            message,
            failure,
            reason,
            lambda _: dead_letters.park(dead_letter_exchange, message, failure, reason=reason),
        )
        if not copied:
            return
        if envelope is not None and park.record_key:
            try:
                await backoff.in_process(self.settings.transient_attempts, log)(
                    self._record_failure, envelope, failure
                )
            except Exception:
                log.exception(
                    "message %s is parked, but its key could not be recorded as failed; a "
                    "redelivery of the key will run again",
                    message.message_id,
                )
        self._count_dead_letter(failure, reason)
        log.warning(
            "dead-lettered message %s (routing key %r): %s: %s",
            message.message_id,
            failure.delivery.routing_key,
            reason,
            failure.error,
        )
        await self.settlements.ack_one(message)

    async def _copy(
        self,
        message: AbstractIncomingMessage,
        failure: Failure,
        reason: Reason,
        publish: Callable[[AbstractExchange], Awaitable[None]],
    ) -> bool:
        """Publish the copy a failure turns ``message`` into (``publish``, given the default
        exchange); True once the broker confirmed it, else the delivery is settled here.

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
        identity = _identity(message)
        if message.redelivered and identity in self._copies_lost:
            del self._copies_lost[identity]
            log.error(
                "message %s came back after its %s copy was lost with the channel; the broker "
                "dead-letters it as it is",
                message.message_id,
                reason,
            )
            await self._reject_to_broker(message, failure, reason)
            return False
        try:
            await publish(topology.default_exchange)
        except Exception as exc:
            if isinstance(exc, aiormq.exceptions.PublishError):  # returned: no queue bound
                await self._pause(
                    PauseReason.DEPLOYMENT,
                    f"the {reason} copy of a message is unroutable: {exc} (queue deleted?)",
                )
                await self.requeue(message, failure.handler)
                return False
            if self._channel_lost(exc):
                log.warning("the copy of message %s was lost: %r", message.message_id, exc)
                self._copies_lost[identity] = None
                while len(self._copies_lost) > LOST_COPIES_REMEMBERED:
                    self._copies_lost.popitem(last=False)
                await self.requeue(message, failure.handler)  # (void: the broker redelivers)
                return False
            log.exception(
                "the broker refused the %s copy of message %s; it dead-letters it as it is",
                reason,
                message.message_id,
            )
            await self._reject_to_broker(message, failure, reason)
            return False
        return True

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

    async def _record_failure(self, envelope: Envelope, failure: Failure) -> None:
        async with self.engine.begin() as conn:
            await inbox.record_failure(
                conn, envelope.claim, error=failure.error, attempts=failure.attempts
            )

    async def _database_answers(self) -> bool:
        try:
            await database.probe(self.engine)
        except Exception as exc:
            log.warning("PostgreSQL does not answer: %r", exc)
            return False
        return True
