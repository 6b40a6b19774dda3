"""Counting dead letters: each in the tally, and those in a row toward the throttle they set:
after ``failure_throttle_after`` of them the consumer takes one message at a time,
``failure_throttle_delay`` apart, until one succeeds.

Invariant: every dead letter is counted here once; only those that are a sign of a broken handler
count toward the throttle: a handler's failure (``core.policy.Park.paces``), and not one taken
out of a batch whose other messages just committed (``beside_successes``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from worker.core.outcomes import Outcome
from worker.errors import Reason
from worker.settings import Settings, format_duration
from worker.telemetry import Telemetry

log = logging.getLogger(__name__)


class DeadLetterStreak:
    """Counts dead letters in a row for one consumer; ``throttled`` while they are too many."""

    def __init__(self, settings: Settings, telemetry: Telemetry) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self._in_a_row = 0
        self._beside_successes = 0

    @property
    def throttled(self) -> bool:
        """True while dead letters in a row hold the consumer to one message at a time."""
        limit = self.settings.failure_throttle_after
        return limit > 0 and self._in_a_row >= limit

    def succeeded(self) -> None:
        """A message ended well: dead letters are no longer in a row."""
        if self.throttled:
            self.telemetry.throttled(False)
            log.warning("a message succeeded: back to full speed")
        self._in_a_row = 0

    @contextlib.contextmanager
    def beside_successes(self) -> Iterator[None]:
        """Dead letters inside are not in a row: they were taken out of a batch whose other
        messages just committed, so the handler works and this is no reason to slow down."""
        self._beside_successes += 1
        try:
            yield
        finally:
            self._beside_successes -= 1

    def dead_lettered(self, handler: str | None, reason: Reason, *, paces: bool) -> None:
        """Count one delivery of ``handler`` dead-lettered for ``reason`` (``Tally.record``), and,
        when it ``paces`` (its handler failed), one more dead letter in a row; slow down when
        there are too many."""
        self.telemetry.tally.record(handler, Outcome.DEAD_LETTERED, reason)
        if self._beside_successes or not paces:
            return
        self._in_a_row += 1
        if self._in_a_row == self.settings.failure_throttle_after:
            self.telemetry.throttled(True)
            log.error(
                "%d messages in a row failed in their handler and were dead-lettered: taking one "
                "message at a time, %s apart, until one succeeds (a handler bug or a bad "
                "deployment? see the DLQ)",
                self._in_a_row,
                format_duration(self.settings.failure_throttle_delay),
            )
