"""Publishing the copies failed deliveries are turned into, and settling each delivery by what
became of its copy: DLQ copies, delayed-retry copies, quorum returns, and the broker's own
dead-lettering (``reject``) when a copy cannot be published.

Invariant: a delivery is acked only after the broker confirmed its copy, and a failed copy never
sends its delivery round and round: a copy lost with its channel returns the delivery to the
queue once (the lost copies are remembered), and a delivery that comes back after that, or whose
copy the broker refused, is dead-lettered by the broker as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import aiormq.exceptions
from aio_pika.abc import AbstractChannel

from worker import logs
from worker.core.envelope import IDEMPOTENCY_KEY_HEADER, Envelope
from worker.core.outcomes import Outcome
from worker.core.policy import handlers_failure
from worker.errors import Fault, PauseReason, Reason, classify
from worker.settings import Settings
from worker.sql.parkings import ParkingRow
from worker.telemetry import Count, Telemetry
from worker.transport import dead_letters
from worker.transport.acks import Settlements
from worker.transport.dead_letters import Failure
from worker.transport.deliveries import Received
from worker.transport.pause import PauseGate
from worker.transport.streak import DeadLetterStreak
from worker.transport.subscription import Subscription

log = logging.getLogger(__name__)

LOST_COPIES_REMEMBERED = 10_000
"""Deliveries whose failure copy was lost with the channel, remembered to break a cycle."""

Publish = Callable[[AbstractChannel], Awaitable[None]]
"""Publishes the copy a failure turns a delivery into, given the consumer's channel (the lean
``transport.publisher``, no aio-pika ``Message``); returns after the broker's confirm."""


@dataclass(frozen=True)
class FailureCopy:
    """The copy (DLQ or delayed-retry) a failed delivery, ``message``, is turned into, for
    ``reason``, sent by ``publish`` (``envelope`` None when the delivery failed its checks);
    ``paces`` when it failed in its handler (``core.policy.handlers_failure``)."""

    message: Received
    envelope: Envelope | None
    failure: Failure
    reason: Reason
    publish: Publish
    paces: bool

    def logged(self) -> contextlib.AbstractContextManager[None]:
        """Tag the records logged inside with the delivery's identity."""
        return logs.message_context(self.failure.delivery, self.envelope)


async def _confirmed(publishes: Iterable[Awaitable[object]]) -> list[Exception | None]:
    """Await ``publishes`` all at once: for each, None once the broker confirmed it, else the
    error that kept it from being confirmed. A cancellation is raised: the shutdown's grace
    period is over."""
    outcomes = await asyncio.gather(*publishes, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome
    return [outcome if isinstance(outcome, Exception) else None for outcome in outcomes]


def _identity(message: Received) -> tuple[object, ...]:
    """What tells one message from another across its redeliveries (tags change)."""
    headers = message.headers or {}
    return (
        message.message_id,
        message.routing_key,
        str(headers.get(IDEMPOTENCY_KEY_HEADER)),
        len(message.body),
        hash(message.body),
    )


class CopyPublisher:
    """Publishes one consumer's failure copies on its ``subscription``'s channel and settles
    their deliveries (see the module docstring); an unroutable copy pauses the consumer
    (``gate``), a delivery the broker dead-letters counts in the ``streak``."""

    def __init__(
        self,
        settings: Settings,
        subscription: Subscription,
        settlements: Settlements,
        telemetry: Telemetry,
        streak: DeadLetterStreak,
        gate: PauseGate,
    ) -> None:
        self.settings = settings
        self.subscription = subscription
        self.settlements = settlements
        self.telemetry = telemetry
        self.streak = streak
        self.gate = gate
        self._lost: OrderedDict[tuple[object, ...], None] = OrderedDict()

    def dlq_copy(
        self,
        message: Received,
        envelope: Envelope | None,
        failure: Failure,
        reason: Reason,
        record: ParkingRow,
        *,
        paces: bool,
    ) -> FailureCopy:
        """The copy that parks ``message`` in the dead-letter queue, as ``record`` says."""
        topology = self.subscription.topology
        assert topology is not None
        exchange = topology.dead_letter_exchange.name

        async def publish(channel: AbstractChannel) -> None:
            await dead_letters.park(channel, exchange, message, failure, record)

        return FailureCopy(message, envelope, failure, reason, publish, paces)

    @staticmethod
    def retry_copy(
        message: Received,
        envelope: Envelope | None,
        failure: Failure,
        retry_queue: str,
    ) -> FailureCopy:
        """The copy that waits in ``retry_queue`` to come back to the work queue."""

        async def publish(channel: AbstractChannel) -> None:
            await dead_letters.schedule_retry(channel, message, failure, retry_queue=retry_queue)

        reason = Reason.RETRY_FAILED
        paces = handlers_failure(reason, opened=envelope is not None)
        return FailureCopy(message, envelope, failure, reason, publish, paces)

    async def requeue(self, message: Received, handler: str | None) -> None:
        """Return ``message`` to the queue untouched (a fault that is not the message's)."""
        await self.requeue_all([(message, handler)])

    async def requeue_all(self, returned: Sequence[tuple[Received, str | None]]) -> None:
        """Return each delivery (with its handler's name, for the tally) to the queue untouched.

        A quorum queue with a delivery limit counts a return as a failed delivery: pauses
        repeated often enough (a deployment fault tried again for an hour) would have the broker
        dead-letter messages that did nothing wrong. There each goes back as a copy at the
        queue's tail (its count starts again): the copies are published at once, and each
        original is acked once the broker confirmed its copy; one whose copy failed is returned
        as it is.
        """
        for _, handler in returned:
            self.telemetry.tally.record(handler, Outcome.REQUEUED)
        messages = [message for message, _ in returned]
        topology = self.subscription.topology
        copied = [False] * len(messages)
        if self.settings.work_queue_delivery_limit > 0 and topology is not None:
            errors = await _confirmed(
                dead_letters.move(topology.channel, message, queue=self.settings.queue)
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

    async def publish(self, copies: Sequence[FailureCopy]) -> list[bool]:
        """Publish ``copies`` at once; for each, True once the broker confirmed it, else its
        delivery is settled here.

        An unroutable copy (its queue was deleted) is the deployment's fault: consumption
        pauses, and declares the topology again before it resumes. If the broker refused the
        copy otherwise while the channel lives (nacked, or the client could not encode it), or
        if the delivery comes back redelivered after its copy cost the channel before (a copy
        over the broker's size limit closes it), the broker's own dead-lettering parks the
        original as it is (``reject``). Only a copy lost with its channel returns the delivery
        to the queue, once.
        """
        topology = self.subscription.topology
        assert topology is not None
        confirmed = [False] * len(copies)
        sending: list[int] = []
        for index, copy in enumerate(copies):
            message = copy.message
            identity = _identity(message)
            if message.redelivered and identity in self._lost:
                del self._lost[identity]
                with copy.logged():
                    log.error(
                        "message %s came back after its %s copy was lost with the channel; the "
                        "broker dead-letters it as it is",
                        message.message_id,
                        copy.reason,
                    )
                    await self._reject_to_broker(copy)
            else:
                sending.append(index)
        errors = await _confirmed(copies[index].publish(topology.channel) for index in sending)
        for index, error in zip(sending, errors, strict=True):
            if error is None:
                confirmed[index] = True
            else:
                with copies[index].logged():
                    await self._settle_unconfirmed(copies[index], error)
        return confirmed

    async def _settle_unconfirmed(self, copy: FailureCopy, exc: Exception) -> None:
        """Settle the delivery whose copy ``exc`` kept from being confirmed (see ``publish``)."""
        message, failure, reason = copy.message, copy.failure, copy.reason
        if isinstance(exc, aiormq.exceptions.PublishError):  # returned: no queue bound
            await self.gate.pause(
                PauseReason.DEPLOYMENT,
                f"the {reason} copy of a message is unroutable: {exc} (queue deleted?)",
            )
            await self.requeue(message, failure.handler)
            return
        if self.subscription.channel_lost or classify(exc) is Fault.TRANSIENT:
            log.warning("the copy of message %s was lost: %r", message.message_id, exc)
            self._lost[_identity(message)] = None
            while len(self._lost) > LOST_COPIES_REMEMBERED:
                self._lost.popitem(last=False)
            await self.requeue(message, failure.handler)  # (void: the broker redelivers)
            return
        log.error(
            "the broker refused the %s copy of message %s; it dead-letters it as it is",
            reason,
            message.message_id,
            exc_info=exc,
        )
        await self._reject_to_broker(copy)

    async def _reject_to_broker(self, copy: FailureCopy) -> None:
        """Let the work queue's dead-letter exchange park ``copy``'s delivery as it is
        (``x-death``)."""
        self.telemetry.count(Count.REJECTED_TO_BROKER)
        self.streak.dead_lettered(copy.failure.handler, copy.reason, paces=copy.paces)
        await self.settlements.reject(copy.message)
