"""How a delivery ended: one enum, from the unit of work to the metric label and the log line.

Invariant: every delivery the consumer takes ends in exactly one ``Outcome``, counted once. The
values are the ``outcome`` label of ``worker_messages_total`` and the names in the consumer's
stats; a ``StrEnum`` formats as its value, so labels and log text read the same as plain strings.
A dead letter's why is an ``errors.Reason``.
"""

from __future__ import annotations

import enum


class Outcome(enum.StrEnum):
    """How a delivery ended. The unit of work ends in the first four (when it does not raise);
    the failure path in the last three."""

    PROCESSED = "processed"
    """Its handler ran and its effect committed."""
    DUPLICATE = "duplicate"
    """Its key was completed before: acked without running again."""
    DUPLICATE_OF_FAILED = "duplicate_of_failed"
    """Its key was recorded as failed before: acked without running until a DLQ replay."""
    WAITING = "waiting"
    """Its workflow registered a wait and released itself: acked, resumed by the wait's signal
    or timer."""
    RETRY_SCHEDULED = "retry_scheduled"
    """Failed transiently: a copy waits in a delayed-retry queue."""
    DEAD_LETTERED = "dead_lettered"
    """Parked in the dead-letter queue (or by the broker's own dead-lettering), with a reason."""
    REQUEUED = "requeued"
    """Returned to the work queue untouched: the database or the deployment was at fault."""
