"""The failure policy as a table: (exception, facts, settings) → where the delivery goes.

No services: ``decide`` is pure. Each row is one path a failure can take; together they show that
every path ends (parked, or a bounded retry, or a pause that parks nothing).
"""

from __future__ import annotations

import pytest

from tests.helpers import FAILOVER_ERRORS
from worker.core.envelope import Delivery
from worker.core.policy import (
    Decision,
    FailureFacts,
    Park,
    Pause,
    PolicySettings,
    RetryInProcess,
    RetryLater,
    RetryQueue,
    asks_database,
    decide,
    in_process_delay,
)
from worker.errors import (
    BodyTooLarge,
    CheckFailed,
    HandlerFailed,
    InvalidBody,
    KeyReused,
    NoHandler,
    PauseReason,
    Permanent,
    Reason,
    Retryable,
    UndecodableBody,
)
from worker.settings import Settings


class _SqlState(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def _wrapped(outer: Exception, inner: BaseException) -> Exception:
    outer.__cause__ = inner
    return outer


QUEUES = (RetryQueue(1.0, "work.retry.1s"), RetryQueue(10.0, "work.retry.10s"))
POLICY = PolicySettings(transient_attempts=3, retry_queues=QUEUES)
NO_DELAYED_RETRIES = PolicySettings(transient_attempts=3)
ONE_TRY = PolicySettings(transient_attempts=1, retry_queues=QUEUES)

OPENED_SPENT = FailureFacts(attempt=1, tries=3, database_answers=True)
"""A first delivery whose in-process tries are spent, and the database answers."""


@pytest.mark.parametrize(
    ("exc", "facts", "settings", "expected"),
    [
        # Given a transient failure with tries left in process, Then try again after a backoff
        (Retryable(), FailureFacts(tries=1), POLICY, RetryInProcess(0.1)),
        (TimeoutError(), FailureFacts(tries=2), POLICY, RetryInProcess(0.2)),
        # Given the tries in process are spent, Then the next delayed-retry queue
        (Retryable(), OPENED_SPENT, POLICY, RetryLater(QUEUES[0])),
        (ConnectionError(), FailureFacts(attempt=2, tries=3), POLICY, RetryLater(QUEUES[1])),
        (Retryable(), FailureFacts(attempt=1, tries=1), ONE_TRY, RetryLater(QUEUES[0])),
        # Given the delayed retries are spent too, Then park it: the chain ends
        (
            Retryable(),
            FailureFacts(attempt=3, tries=3),
            POLICY,
            Park(Reason.RETRIES_EXHAUSTED, record_key=True, paces=True),
        ),
        (
            Retryable(),
            OPENED_SPENT,
            NO_DELAYED_RETRIES,
            Park(Reason.RETRIES_EXHAUSTED, record_key=True, paces=True),
        ),
        # Given a transient error while checking (no key, nothing ran), Then no try in process
        (
            _wrapped(CheckFailed(), OSError()),
            FailureFacts(tries=0),
            POLICY,
            RetryLater(QUEUES[0]),
        ),
        (
            _wrapped(CheckFailed(), OSError()),
            FailureFacts(attempt=3, tries=0),
            POLICY,
            Park(Reason.RETRIES_EXHAUSTED, record_key=False, paces=False),
        ),
        # Given a rejection, Then park it with its reason; a key is recorded if it has one, and
        # only a handler's failure paces the consumer: one the checks refused is the sender's
        (
            InvalidBody(),
            FailureFacts(tries=0),
            POLICY,
            Park(Reason.INVALID, record_key=False, paces=False),
        ),
        (BodyTooLarge(), FailureFacts(tries=0), POLICY, Park(Reason.BODY_TOO_LARGE, False, False)),
        (UndecodableBody(), FailureFacts(tries=0), POLICY, Park(Reason.UNDECODABLE, False, False)),
        (NoHandler(), FailureFacts(tries=0), POLICY, Park(Reason.NO_HANDLER, False, False)),
        (
            HandlerFailed(),
            OPENED_SPENT,
            POLICY,
            Park(Reason.HANDLER_ERROR, record_key=True, paces=True),
        ),
        # … except a reused key: it belongs to the first payload, so it is never marked failed
        (KeyReused(), OPENED_SPENT, POLICY, Park(Reason.KEY_REUSED, record_key=False, paces=False)),
        # Given Permanent before a transient cause, Then it is the message's fault: park
        (
            _wrapped(HandlerFailed(), _wrapped(Permanent(), TimeoutError())),
            OPENED_SPENT,
            POLICY,
            Park(Reason.HANDLER_ERROR, record_key=True, paces=True),
        ),
        # Given an error that is no rejection and not transient (a bug), Then internal-error
        (
            ValueError("bug"),
            OPENED_SPENT,
            POLICY,
            Park(Reason.INTERNAL_ERROR, record_key=True, paces=True),
        ),
        # Given the deployment's fault (SQLSTATE class 42), Then pause: nothing parked
        (_SqlState("42P01"), OPENED_SPENT, POLICY, Pause(PauseReason.DEPLOYMENT)),
        (
            _wrapped(HandlerFailed(), _SqlState("42501")),
            FailureFacts(attempt=3, tries=1),
            POLICY,
            Pause(PauseReason.DEPLOYMENT),
        ),
        # Given PostgreSQL does not answer, Then pause, whatever the error looked like
        (
            HandlerFailed(),
            FailureFacts(tries=3, database_answers=False),
            POLICY,
            Pause(PauseReason.DATABASE_UNREACHABLE),
        ),
        (
            Retryable(),
            FailureFacts(tries=1, database_answers=False),
            POLICY,
            Pause(PauseReason.DATABASE_UNREACHABLE),
        ),
    ],
)
def test_decide(
    exc: BaseException, facts: FailureFacts, settings: PolicySettings, expected: Decision
) -> None:
    assert decide(exc, facts, settings) == expected


@pytest.mark.parametrize("exc", FAILOVER_ERRORS, ids=lambda exc: type(exc).__name__)
@pytest.mark.parametrize("attempt", [1, 3, 10])
def test_a_failover_pauses_whatever_the_attempt_and_parks_nothing(
    exc: BaseException, attempt: int
) -> None:
    # Given a failure of a failover, tries in process left: Then try again in process
    assert decide(exc, FailureFacts(attempt=attempt, tries=1), POLICY) == RetryInProcess(0.1)
    # Given the tries spent and no primary answering the probe: Then pause, even on a delivery
    # whose delayed retries are spent (it would otherwise be parked as retries-exhausted)
    spent = FailureFacts(attempt=attempt, tries=3, database_answers=False)
    assert decide(exc, spent, POLICY) == Pause(PauseReason.DATABASE_UNREACHABLE)


@pytest.mark.parametrize(
    ("tries", "delay"), [(1, 0.1), (2, 0.2), (3, 0.4), (5, 1.6), (6, 2.0), (50, 2.0)]
)
def test_in_process_delay_doubles_up_to_two_seconds(tries: int, delay: float) -> None:
    assert in_process_delay(tries) == pytest.approx(delay)


@pytest.mark.parametrize(
    ("facts", "asked"),
    [
        # Given a delivery that failed its checks, Then it touched no database: nothing to ask
        (FailureFacts(tries=0), False),
        # Given one that failed after them, Then the failure may be an outage in disguise
        (FailureFacts(tries=3), True),
        # … unless PostgreSQL is known to have answered since (its batch then committed)
        (OPENED_SPENT, False),
        (FailureFacts(tries=3, database_answers=False), False),
    ],
)
def test_the_database_is_asked_after_the_checks_unless_its_answer_is_known(
    facts: FailureFacts, asked: bool
) -> None:
    assert asks_database(facts) is asked


def test_settings_give_one_queue_per_delay() -> None:
    settings = Settings(retry_delays=(1.0, 60.0), transient_attempts=2)
    policy = PolicySettings.of(settings)
    assert policy.transient_attempts == 2
    assert policy.retry_queues == (
        RetryQueue(1.0, settings.retry_queue(1.0)),
        RetryQueue(60.0, settings.retry_queue(60.0)),
    )


def test_facts_of_a_delivery_after_its_tries() -> None:
    delivery = Delivery(body=b"{}", routing_key="k", headers={"x-worker-attempts": 2})
    assert FailureFacts.of(delivery, POLICY, opened=True) == FailureFacts(attempt=3, tries=3)
    assert FailureFacts.of(delivery, POLICY, opened=False).tries == 0
