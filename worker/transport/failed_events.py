"""The relay's failed publishes, summarized: one warning per route and interval, not one per row.

An event nobody consumes yet (no queue bound for its routing key) is returned on every attempt
until it is parked; a warning per row and attempt buried the one fact an operator needs under
thousands of lines. Invariant: every failure is counted, and each route's failures reach the log
within ``interval`` seconds of happening. The first failure of a route is logged at once, with
what to do about it; the rest of the interval's are summed into one line (how many failed, how
many of them were parked, the last error) when the interval has passed.
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

SUMMARY_INTERVAL = 60.0
"""Seconds between two warnings about the same route."""

Route = tuple[str, str]
"""(exchange, routing key) of the events that failed."""


@dataclass
class _Pending:
    since: float
    failed: int = 0
    parked: int = 0
    last_error: str = ""


class FailedEvents:
    """Collects failed publishes per route and logs them at most once per ``interval`` each."""

    def __init__(
        self,
        log: logging.Logger,
        *,
        interval: float = SUMMARY_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.interval = interval
        self.clock = clock
        self._pending: dict[Route, _Pending] = {}

    def record(self, route: Route, error: str, *, parked: bool) -> None:
        """Count one failed publish of an event to ``route`` (``parked``: its last attempt, it
        was moved to ``outbox_parked``); the first of an interval is logged at once."""
        now = self.clock()
        pending = self._pending.get(route)
        if pending is None:
            self._pending[route] = _Pending(since=now)
            self._log_first(route, error, parked)
            return
        pending.failed += 1
        pending.parked += parked
        pending.last_error = error

    def flush(self, *, force: bool = False) -> None:
        """Log the summary of each route whose interval has passed (every route: ``force``)."""
        now = self.clock()
        for route, pending in list(self._pending.items()):
            if not force and now - pending.since < self.interval:
                continue
            del self._pending[route]
            if pending.failed:
                self._log_summary(route, pending, now)

    def _log_first(self, route: Route, error: str, parked: bool) -> None:
        exchange, routing_key = route
        self.log.warning(
            "an event for routing key %r on exchange %r %s: %s%s (further failures of this "
            "routing key are summed up every %gs)",
            routing_key,
            exchange,
            "was parked in outbox_parked" if parked else "failed and will be retried",
            error,
            _fix(error, routing_key),
            self.interval,
        )

    def _log_summary(self, route: Route, pending: _Pending, now: float) -> None:
        exchange, routing_key = route
        self.log.warning(
            "%d more events for routing key %r on exchange %r failed in the last %.0fs, %d of "
            "them parked in outbox_parked; last error: %s%s",
            pending.failed,
            routing_key,
            exchange,
            now - pending.since,
            pending.parked,
            pending.last_error,
            _fix(pending.last_error, routing_key),
        )


def _fix(error: str, routing_key: str) -> str:
    """What an operator can do about ``error``, when the relay knows: for an unroutable event,
    the command that lists its routing key's waiting rows and the one that publishes them now."""
    if error.startswith("returned as unroutable"):
        key = shlex.quote(routing_key)
        return (
            f" (bind a queue to the exchange for this routing key; `worker outbox list "
            f"--routing-key {key}` shows the events waiting, and `worker outbox retry "
            f"--routing-key {key}` publishes them at once after the binding)"
        )
    if "does not exist" in error:
        return " (declare the exchange, or fix the events' exchange)"
    return ""
