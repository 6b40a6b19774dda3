"""Handlers whose concurrent batches deadlocked on each other lately, and the lock that makes
their batches take turns.

Two transactions that each run a plain handler for many messages hold the rows those handlers
wrote until they commit; when the handlers touch shared rows (an account's balance, a product's
stock) in the messages' order, two such batches can wait on each other, and PostgreSQL breaks the
deadlock only after ``deadlock_timeout`` (1 s by default), again and again. After a deadlock in a
handler's group, that handler's groups take a transaction-scoped advisory lock for ``hold``
seconds: its batches run one at a time, in every process that has seen the deadlock, and still
many messages per transaction. Handlers that never deadlock keep their concurrency.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from worker.sql import locks

log = logging.getLogger(__name__)

HANDLER_LOCK_CLASS = locks.HANDLER_TURNS
"""First key of the advisory locks that make a contended handler's batches take turns."""

TAKE_TURNS = f"SELECT pg_advisory_xact_lock({HANDLER_LOCK_CLASS}, hashtext($1::text))"

HOLD = 300.0
"""Seconds a handler's batches take turns after its last deadlock."""


class Contention:
    """Which handlers' batches take turns, until when; one per process, shared by its consumers."""

    def __init__(self, hold: float = HOLD, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold = hold
        self._clock = clock
        self._until: dict[str, float] = {}

    def deadlocked(self, handler: str) -> None:
        """``handler``'s group lost a deadlock (or a serialization failure): take turns."""
        if not self.contended(handler):
            log.warning(
                "batches of handler %s deadlocked on each other: they take turns for %gs "
                "(its handler touches shared rows in the messages' order; a batch handler "
                "that writes them in a fixed order need not)",
                handler,
                self.hold,
            )
        self._until[handler] = self._clock() + self.hold

    def contended(self, handler: str) -> bool:
        """Whether ``handler``'s batches take turns now."""
        return self._until.get(handler, float("-inf")) > self._clock()
