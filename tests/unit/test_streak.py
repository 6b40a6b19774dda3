"""The dead-letter streak: every dead letter is tallied, and only handler failures in a row
throttle the consumer."""

from __future__ import annotations

from worker.errors import Reason
from worker.settings import Settings
from worker.telemetry import Count, Telemetry
from worker.transport.streak import DeadLetterStreak


def test_only_handler_failures_in_a_row_throttle_and_a_success_ends_it() -> None:
    # Given a streak that throttles after 3 in a row
    telemetry = Telemetry()
    streak = DeadLetterStreak(Settings(failure_throttle_after=3), telemetry)

    # When many messages the checks refused are parked, Then it does not slow down
    for _ in range(50):
        streak.dead_lettered(None, Reason.UNDECODABLE, paces=False)
    assert not streak.throttled
    # and handler failures in a row do, even with junk between them
    streak.dead_lettered("h", Reason.HANDLER_ERROR, paces=True)
    streak.dead_lettered(None, Reason.NO_HANDLER, paces=False)
    streak.dead_lettered("h", Reason.HANDLER_ERROR, paces=True)
    assert not streak.throttled
    streak.dead_lettered("h", Reason.RETRIES_EXHAUSTED, paces=True)
    assert streak.throttled
    # and each one was tallied, whatever it was
    assert telemetry.stats[Count.DEAD_LETTERED] == 54
    assert telemetry.stats[Count.THROTTLED] == 1

    # When one succeeds, Then it is back to full speed
    streak.succeeded()
    assert not streak.throttled
