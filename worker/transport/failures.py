"""Carrying out the failure policy's decision for a delivery that failed: decide
(``core.policy.decide``, where the policy is stated), then park, retry later, or requeue.

Every delivery it is given ends in exactly one of them, counted once. Parking, in order: the
copies' parking records commit (``core.failure_records``); the DLQ copies are published
(``copies``); the keys the policy says are recorded as failed, in one transaction; the deliveries
are acked. The deliveries of one batch that failed their checks (``failed_checks``), or failed
in its committed transaction (``failed_in_committed_batch``), are parked together: one statement
for their records, their copies published at once and their confirms awaited together, one
settlement of their acks; a crash between two steps leaves them as a crash would leave one
delivery between the same steps.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from sqlalchemy.ext.asyncio import AsyncEngine

from worker import backoff, logs
from worker.core.envelope import Delivery, Envelope
from worker.core.failure_records import commit_failed_keys, commit_parkings
from worker.core.outcomes import Outcome
from worker.core.policy import (
    Decision,
    FailureFacts,
    Park,
    Pause,
    PolicySettings,
    RetryLater,
    asks_database,
    decide,
)
from worker.core.router import Router
from worker.errors import Fault, PauseReason, classify
from worker.faults import FAILURES_PARKED, FAILURES_RECORDED, crash_point
from worker.settings import Settings
from worker.sql.parkings import ParkingRow
from worker.telemetry import Telemetry
from worker.transport.copies import CopyPublisher
from worker.transport.dead_letters import Failure
from worker.transport.deliveries import Received
from worker.transport.pause import PauseGate
from worker.transport.streak import DeadLetterStreak

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailedDelivery:
    """A delivery that failed, on its way to where the policy sends it (``envelope`` None when
    it failed its checks)."""

    message: Received
    envelope: Envelope | None
    failure: Failure

    def logged(self) -> contextlib.AbstractContextManager[None]:
        """Tag the records logged inside with the delivery's identity."""
        return logs.message_context(self.failure.delivery, self.envelope)


def _records_key(delivery: FailedDelivery, park: Park) -> bool:
    """True when parking ``delivery`` records its key as failed in the inbox."""
    return delivery.envelope is not None and park.record_key


class Failures:
    """Routes the failed deliveries of one consumer (see the module docstring): its ``copies``
    publish what they are turned into, its ``gate`` pauses it, its ``streak`` counts each dead
    letter."""

    def __init__(
        self,
        settings: Settings,
        router: Router,
        engine: AsyncEngine,
        copies: CopyPublisher,
        gate: PauseGate,
        streak: DeadLetterStreak,
        telemetry: Telemetry,
    ) -> None:
        self.settings = settings
        self.policy = PolicySettings.of(settings)
        self.router = router
        self.engine = engine
        self.copies = copies
        self.gate = gate
        self.streak = streak
        self.telemetry = telemetry

    async def delivery_failed(
        self,
        message: Received,
        delivery: Delivery,
        envelope: Envelope,
        exc: Exception,
    ) -> None:
        """Carry out the policy's decision for ``message``, which failed with ``exc`` after its
        in-process tries, alone in its unit of work."""
        facts = FailureFacts.of(delivery, self.policy, opened=True)
        if asks_database(facts):
            facts = replace(facts, database_answers=await self.gate.database_answers())
        await self._route([(self._failed_delivery(message, delivery, envelope, exc), facts, exc)])

    async def failed_checks(self, rejected: Sequence[tuple[Received, Delivery, Exception]]) -> None:
        """Carry out the policy's decision for each (delivery, error) of a batch that failed its
        checks: the worker refused them on its own (no key, no unit of work, no database asked
        about them), so those the policy parks are parked together (``_park``), each step once
        for all of them."""
        await self._route(
            [
                (
                    self._failed_delivery(message, delivery, None, exc),
                    FailureFacts.of(delivery, self.policy, opened=False),
                    exc,
                )
                for message, delivery, exc in rejected
            ]
        )

    async def failed_in_committed_batch(
        self, failures: Sequence[tuple[Received, Envelope, Exception]]
    ) -> None:
        """Carry out the policy's decision for each (delivery, envelope, error) of a batch whose
        transaction committed after they failed in it, each failed for good, with distinct keys.

        PostgreSQL answered after these failures (it committed), so it is not probed again; the
        deliveries the policy parks are parked together (``_park``).
        """
        await self._route(
            [
                (
                    self._failed_delivery(message, envelope.delivery, envelope, exc),
                    FailureFacts.of(
                        envelope.delivery, self.policy, opened=True, database_answers=True
                    ),
                    exc,
                )
                for message, envelope, exc in failures
            ]
        )

    async def _route(
        self, failures: Sequence[tuple[FailedDelivery, FailureFacts, Exception]]
    ) -> None:
        """Decide for each (failed delivery, facts, error); park those the policy parks
        together, then send each other one its way on its own."""
        to_park: list[tuple[FailedDelivery, Park]] = []
        elsewhere: list[tuple[FailedDelivery, Decision, Exception]] = []
        for failed, facts, exc in failures:
            decision = decide(exc, facts, self.policy)
            if isinstance(decision, Park):
                to_park.append(self._to_park(failed, decision, exc))
            else:
                elsewhere.append((failed, decision, exc))
        await self._park(to_park)
        for failed, decision, exc in elsewhere:
            with failed.logged():
                await self._carry_out(failed, decision, exc)

    def _failed_delivery(
        self,
        message: Received,
        delivery: Delivery,
        envelope: Envelope | None,
        exc: Exception,
    ) -> FailedDelivery:
        handler = (
            envelope.handler if envelope is not None else self.router.find(delivery.routing_key)
        )
        return FailedDelivery(message, envelope, Failure.of(delivery, exc, handler))

    @staticmethod
    def _to_park(failed: FailedDelivery, park: Park, exc: Exception) -> tuple[FailedDelivery, Park]:
        if park.unexpected:
            with failed.logged():
                log.error(
                    "unexpected failure for message %s", failed.message.message_id, exc_info=exc
                )
        return failed, park

    async def _carry_out(self, failed: FailedDelivery, decision: Decision, exc: Exception) -> None:
        """Carry out a decision that parks nothing: a pause, or a delayed retry."""
        if isinstance(decision, Pause):
            detail = (
                self.gate.unreachable_because
                if decision.reason is PauseReason.DATABASE_UNREACHABLE
                else logs.describe_error(exc)
            )
            await self.gate.pause(decision.reason, detail)
            await self.copies.requeue(failed.message, failed.failure.handler)
        elif isinstance(decision, RetryLater):
            await self._retry_later(failed, decision.queue.name, decision.queue.delay)
        else:  # RetryInProcess: the facts say the in-process tries are spent
            raise AssertionError(
                f"{decision} after the in-process tries of {failed.failure.delivery.message_id}"
            )

    async def _retry_later(self, failed: FailedDelivery, queue: str, delay: float) -> None:
        copy = self.copies.retry_copy(failed.message, failed.envelope, failed.failure, queue)
        [copied] = await self.copies.publish([copy])
        if not copied:
            return
        failure = failed.failure
        self.telemetry.tally.record(failure.handler, Outcome.RETRY_SCHEDULED)
        log.warning(
            "attempt %d of message %s failed transiently; retrying in %gs: %s",
            failure.attempts,
            failed.message.message_id,
            delay,
            failure.error,
        )
        await self.copies.settlements.ack_one(failed.message)

    async def _park(self, to_park: Sequence[tuple[FailedDelivery, Park]]) -> None:
        """Park each in the DLQ; then record the keys the policy says as failed, all in one
        transaction; then ack them.

        Parking comes first: a crash before the acks parks a delivery twice at worst, while a
        recorded failure without a parked copy would leave nothing to replay. A delivery whose
        copy was not confirmed was settled otherwise (``CopyPublisher.publish``) and is neither
        recorded nor acked here. Once the broker confirmed a copy, its delivery is acked
        whatever happens to the record (the copy is the record).
        """
        if not to_park:
            return
        records = [
            failed.failure.parking(park.reason, failed_key=_records_key(failed, park))
            for failed, park in to_park
        ]
        if not await self._commit_parkings(to_park, records):
            return
        copied = await self.copies.publish(
            [
                self.copies.dlq_copy(
                    failed.message,
                    failed.envelope,
                    failed.failure,
                    park.reason,
                    record,
                    paces=park.paces,
                )
                for (failed, park), record in zip(to_park, records, strict=True)
            ]
        )
        parked = [
            (failed, park, record)
            for (failed, park), record, ok in zip(to_park, records, copied, strict=True)
            if ok
        ]
        if not parked:
            return
        crash_point(FAILURES_PARKED, len(parked))
        await self._commit_failed_keys([f for f, park, _ in parked if _records_key(f, park)])
        crash_point(FAILURES_RECORDED, len(parked))
        for failed, park, record in parked:
            self.streak.dead_lettered(failed.failure.handler, park.reason, paces=park.paces)
            with failed.logged():
                log.warning(
                    "dead-lettered message %s (routing key %r) as parking %s "
                    "(`worker dlq show` takes it): %s: %s",
                    failed.message.message_id,
                    failed.failure.delivery.routing_key,
                    record.parking_id,
                    park.reason,
                    failed.failure.error,
                )
        await self.copies.settlements.ack([failed.message for failed, _, _ in parked])

    async def _commit_parkings(
        self, to_park: Sequence[tuple[FailedDelivery, Park]], records: Sequence[ParkingRow]
    ) -> bool:
        """Commit ``records`` (the provenance of the copies about to be parked), tried again in
        process while it fails transiently; False when it could not be: then nothing is parked,
        consumption pauses and the deliveries return to the queue."""
        try:
            await backoff.in_process(self.settings.transient_attempts, log)(
                commit_parkings, self.engine, records
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
            await self.gate.pause(
                reason, f"cannot record a dead-letter parking: {logs.describe_error(exc)}"
            )
            await self.copies.requeue_all(
                [(failed.message, failed.failure.handler) for failed, _ in to_park]
            )
            return False
        return True

    async def _commit_failed_keys(self, parked: Sequence[FailedDelivery]) -> None:
        """Record the keys of ``parked`` (each with an envelope) as failed, in one transaction
        tried again in process while it fails transiently; if it cannot be, say so and go on
        (their copies are parked: a redelivery of such a key runs again)."""
        if not parked:
            return
        failed_keys = [
            (failed.envelope.claim, failed.failure.error, failed.failure.attempts)
            for failed in parked
            if failed.envelope is not None
        ]
        try:
            await backoff.in_process(self.settings.transient_attempts, log)(
                commit_failed_keys, self.engine, failed_keys
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
