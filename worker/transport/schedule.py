"""The relay's clock for scheduled events: when they are due, it moves them into the outbox.

Invariant: a scheduled event enters ``outbox`` only once the database's ``now()`` has reached its
``due_at`` (``outbox.move_due`` decides that in SQL, never this process's clock), so no relay can
publish it early. This module only decides *when to ask*: at start (events may have fallen due
while no relay ran), when a commit scheduled new events (a NOTIFY ``scheduled``), when the
earliest one is due by the database's reckoning, and at least every poll interval (a commit whose
NOTIFY was missed). A move takes at most ``batch`` events, so a relay that comes back to a
backlog of due events moves them batch after batch, each claimed and published in the meantime.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from worker.faults import SCHEDULE_BEFORE_COMMIT, crash_point
from worker.sql import outbox
from worker.telemetry import Count, Telemetry

log = logging.getLogger(__name__)

MIN_GAP = 0.05
"""Shortest wait, in seconds, between two moves while events keep falling due: events due within
it are moved together, so a steady 1,000 due events/s cost 20 small transactions/s, not 1,000."""


class Schedule:
    """When the relay should look for due scheduled events, and the move itself."""

    def __init__(
        self, engine: AsyncEngine, *, batch: int, poll_interval: float, telemetry: Telemetry
    ) -> None:
        self.engine = engine
        self.batch = batch
        self.poll_interval = poll_interval
        self.telemetry = telemetry
        self._next = 0.0
        """Loop time of the next look; 0: look now."""
        self._notices = 0
        """How many notices were heard: one heard while a move runs makes the next look now."""

    def notice(self) -> None:
        """New events were scheduled (a NOTIFY ``scheduled``): the earliest may be due sooner."""
        self._next = 0.0
        self._notices += 1

    def seconds_until_due(self) -> float:
        """How long the relay may sleep before it should look again (0: now)."""
        return max(0.0, self._next - asyncio.get_running_loop().time())

    async def move_due(self) -> int:
        """If it is time to look, move the due events (at most ``batch``) into the outbox in one
        transaction and learn from the database when to look next; returns how many moved."""
        now = asyncio.get_running_loop().time()
        if now < self._next:
            return 0
        notices = self._notices
        async with self.engine.connect() as conn, conn.begin():
            moved = await outbox.move_due(conn, self.batch)
            if moved:
                crash_point(SCHEDULE_BEFORE_COMMIT, moved)
            due_in = None if moved >= self.batch else await outbox.next_due_in(conn)
        if moved:
            log.debug("moved %d due scheduled event(s) into the outbox", moved)
            self.telemetry.count(Count.SCHEDULED_DUE, moved)
        if moved >= self.batch:
            self._next = now  # more are due: move again after this batch is claimed
        elif due_in is None:
            self._next = now + self.poll_interval
        else:
            self._next = now + min(max(due_in, MIN_GAP), self.poll_interval)
        if self._notices != notices:  # the database may have answered before that commit
            self._next = now
        return moved
