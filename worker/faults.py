"""Named crash points for crash-consistency tests; inert unless ``WORKER_CRASH_AT`` names one.

A test starts a worker process with ``WORKER_CRASH_AT=<point>`` (or ``<point>@<n>``: the n-th
time the point is reached, a batch counting once per message); when the process gets there it
kills itself with SIGKILL, as a power cut would, with no cleanup of any kind. Unset, a crash
point costs one comparison.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

CRASH_ENV = "WORKER_CRASH_AT"

CONSUMER_BEFORE_CLAIM = "consumer.before_claim"
"""A delivery passed its checks; its transaction has not begun."""

UNIT_OF_WORK_BEFORE_COMMIT = "unit_of_work.before_commit"
"""The handler ran and the outbox rows and completion are written; the commit has not happened."""

UNIT_OF_WORK_ISOLATING = "unit_of_work.isolating"
"""A handler failed inside a batch and its group was rolled back to its savepoint; the group has
not yet run again without the culprit, and nothing has committed."""

CONSUMER_AFTER_COMMIT = "consumer.after_commit"
"""The unit of work committed; the delivery has not been acked."""

FAILURES_PARKED = "failures.parked"
"""The broker confirmed the dead-letter copies of deliveries being parked; their keys are not
recorded as failed yet, and the deliveries are not acked."""

FAILURES_RECORDED = "failures.recorded"
"""The keys of parked deliveries are recorded as failed (committed); the deliveries are not
acked yet."""

RELAY_MID_BATCH = "relay.mid_batch"
"""A row of the relay's batch was confirmed by the broker; others may not be, none is deleted."""

RELAY_AFTER_PUBLISH = "relay.after_publish"
"""After the relay's batch was confirmed by the broker, before its rows are deleted."""

SCHEDULE_BEFORE_COMMIT = "schedule.before_commit"
"""The relay moved due scheduled events into the outbox; the move has not committed (so they
are still scheduled, and due)."""

WORKFLOW_WAIT_REGISTERED = "workflow.wait_registered"
"""A workflow's wait and its timer committed and its lease is released; the delivery that
registered them has not been acked (its redelivery finds the wait open and suspends again)."""

WORKFLOW_TIMEOUT_BEFORE_COMMIT = "workflow.timeout_before_commit"
"""A wait whose deadline passed is resolved as timed out (by its timer's delivery); that
transaction has not committed."""

WORKFLOW_RESUMED_BEFORE_COMMIT = "workflow.resumed_before_commit"
"""A signal resolved its open waits, cancelled their timers and appended their resume messages;
its unit of work has not committed."""

CONSUMER_DRAINING = "consumer.draining"
"""Shutting down: consuming was cancelled, units of work in flight are still running."""

POINTS = (
    CONSUMER_BEFORE_CLAIM,
    UNIT_OF_WORK_BEFORE_COMMIT,
    UNIT_OF_WORK_ISOLATING,
    CONSUMER_AFTER_COMMIT,
    FAILURES_PARKED,
    FAILURES_RECORDED,
    RELAY_MID_BATCH,
    RELAY_AFTER_PUBLISH,
    SCHEDULE_BEFORE_COMMIT,
    WORKFLOW_WAIT_REGISTERED,
    WORKFLOW_TIMEOUT_BEFORE_COMMIT,
    WORKFLOW_RESUMED_BEFORE_COMMIT,
    CONSUMER_DRAINING,
)
"""Every fixed crash point; workflows add ``workflow.after_step:<step>`` and
``workflow.before_commit:<step>``."""


def _armed(raw: str | None) -> tuple[str | None, int]:
    if not raw:
        return None, 0
    name, _, count = raw.partition("@")
    return name, int(count) if count else 1


_ARMED, _AT = _armed(os.environ.get(CRASH_ENV))
_hits = 0


def crash_point(name: str, messages: int = 1) -> None:
    """Die at once with SIGKILL if this process was started to crash at ``name`` (this time).

    A point reached for a batch counts once per message in it, so ``<point>@<n>`` crashes at
    the batch holding the n-th message, whatever the batch size."""
    global _hits
    if name != _ARMED:
        return
    _hits += messages
    if _hits >= _AT:
        log.critical("crash point %s reached (time %d): killing the process", name, _hits)
        os.kill(os.getpid(), signal.SIGKILL)
