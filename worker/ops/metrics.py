"""Prometheus metrics, served on ``/metrics`` (by ``http.HttpServer``).

Invariant: every metric lives in the ``CollectorRegistry`` of one ``Metrics`` object, never in
prometheus-client's global registry, so several workers (or tests) in one process cannot collide,
and rendering reads numbers already in memory only. How deliveries ended is counted once, in the
``Tally``; the other counters and histograms are updated where things happen (relay, janitor,
consumer); the gauges are read from the database by ``Metrics.refresh``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter as Tallies
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.core.outcomes import Outcome
from worker.database import PROBE_TIMEOUT
from worker.errors import PauseReason, Reason
from worker.sql import inspection
from worker.sql.tables import INBOX_STATUSES

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "Tally"]

RELAY_RESULTS = ("published", "failed", "parked")
"""The ``result`` label of ``worker_relay_messages_total``."""

TRANSACTION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class Tally:
    """How deliveries ended, each counted once, in one place: ``record``.

    Invariant: ``/metrics`` (``worker_messages_total`` by handler and outcome,
    ``worker_dead_letters_total`` by handler and reason) and ``stats`` (what the stats log line
    and tests read: ``processed``, ``dead_lettered``, ``dead_lettered:<reason>``, …) are both
    written by the one ``record`` call a delivery's end makes, so they cannot disagree. ``stats``
    is the process's shared counter (the relay and the janitor add their own names to it).
    """

    def __init__(self, stats: Tallies[str] | None = None) -> None:
        self.stats: Tallies[str] = Tallies() if stats is None else stats
        self._ends: Tallies[tuple[str, Outcome, Reason | None]] = Tallies()

    def record(self, handler: str | None, outcome: Outcome, reason: Reason | None = None) -> None:
        """Count one delivery of ``handler`` (None: none was found) that ended with ``outcome``;
        a dead letter, and only a dead letter, has a ``reason``."""
        if (outcome is Outcome.DEAD_LETTERED) != (reason is not None):
            raise ValueError(f"a dead letter, and only a dead letter, has a reason: {outcome}")
        self._ends[(handler or "", outcome, reason)] += 1
        self.stats[outcome.value] += 1
        if reason is not None:
            self.stats[f"{outcome.value}:{reason.value}"] += 1

    def collect(self) -> Iterable[Metric]:
        """The two counters, as a Prometheus collector (``CollectorRegistry.register``)."""
        messages = CounterMetricFamily(
            "worker_messages_total", "Deliveries by how they ended.", labels=["handler", "outcome"]
        )
        dead_letters = CounterMetricFamily(
            "worker_dead_letters_total",
            "Deliveries parked in the dead-letter queue, by reason (x-worker-reason).",
            labels=["handler", "reason"],
        )
        by_outcome: Tallies[tuple[str, Outcome]] = Tallies()
        for (handler, outcome, reason), count in self._ends.items():
            by_outcome[(handler, outcome)] += count
            if reason is not None:
                dead_letters.add_metric([handler, reason.value], count)
        for (handler, outcome), count in by_outcome.items():
            messages.add_metric([handler, outcome.value], count)
        return [messages, dead_letters]


class Metrics:
    """The worker's Prometheus metrics, in a registry of their own (``registry``).

    How deliveries ended is counted in ``tally`` (``Tally.record``), which the registry reads;
    ``stats`` given, the tally counts into it too. ``handler`` is the handler's name, or None
    when none was found (the label is then empty).
    """

    def __init__(self, stats: Tallies[str] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.tally = Tally(stats)
        r.register(self.tally)
        self.transaction_seconds = Histogram(
            "worker_transaction_seconds",
            "Duration of a unit of work (one transaction, or a workflow's run), failed ones too.",
            ["handler"],
            buckets=TRANSACTION_BUCKETS,
            registry=r,
        )
        self.batch_messages = Histogram(
            "worker_batch_messages",
            "Deliveries per consumer transaction (a batch); one for a message handled alone.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.consumer_pauses = Counter(
            "worker_consumer_pauses_total",
            "Times consumption paused because PostgreSQL was unreachable or the deployment "
            "(schema, privileges) did not match the code.",
            registry=r,
        )
        self.consumer_paused = Gauge(
            "worker_consumer_paused",
            "1 while consumption is paused, by why: database-unreachable or deployment.",
            ["reason"],
            registry=r,
        )
        self.consumer_throttled = Gauge(
            "worker_consumer_throttled",
            "1 while the consumer takes one message at a time after consecutive dead letters.",
            registry=r,
        )
        self.relay_batch_rows = Histogram(
            "worker_relay_batch_rows",
            "Outbox rows claimed per relay batch (batches that claimed at least one).",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.relay_messages = Counter(
            "worker_relay_messages_total",
            "Outbox rows by publish result; failed rows are retried, parked ones gave up.",
            ["result"],
            registry=r,
        )
        self.inbox_expired = Counter(
            "worker_inbox_expired_total",
            "Inbox keys deleted by the janitor after their retention.",
            registry=r,
        )
        self.outbox_backlog = Gauge(
            "worker_outbox_backlog", "Outbox rows not yet published.", registry=r
        )
        self.outbox_oldest_age = Gauge(
            "worker_outbox_oldest_age_seconds",
            "Age of the oldest unpublished outbox row; 0 when the outbox is empty.",
            registry=r,
        )
        self.outbox_parked = Gauge(
            "worker_outbox_parked", "Rows in outbox_parked, given up by the relay.", registry=r
        )
        self.inbox_rows = Gauge(
            "worker_inbox_rows",
            "Inbox keys by status; estimated from PostgreSQL's statistics above "
            f"{inspection.EXACT_INBOX_COUNT_LIMIT:,} keys.",
            ["status"],
            registry=r,
        )
        self.inbox_rows_estimated = Gauge(
            "worker_inbox_rows_estimated",
            "1 when worker_inbox_rows was last estimated (completed and failed), 0 when counted.",
            registry=r,
        )
        self.http_refused = Counter(
            "worker_http_connections_refused_total",
            "Connections to this endpoint closed unread: http_max_connections were open.",
            registry=r,
        )
        for result in RELAY_RESULTS:
            self.relay_messages.labels(result)
        for status in INBOX_STATUSES:
            self.inbox_rows.labels(status)
        self.paused(None)

    def message(self, handler: str | None, outcome: Outcome | str) -> None:
        """Count a delivery that ended with ``outcome`` (an ``Outcome``, not a dead letter)."""
        if outcome not in set(Outcome):
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {list(Outcome)}")
        if outcome == Outcome.DEAD_LETTERED:
            raise ValueError("count dead letters with dead_letter(handler, reason)")
        self.tally.record(handler, Outcome(outcome))

    def dead_letter(self, handler: str | None, reason: Reason | str) -> None:
        """Count a delivery parked in the dead-letter queue with ``reason`` (a ``Reason``)."""
        self.tally.record(handler, Outcome.DEAD_LETTERED, Reason(reason))

    @contextlib.contextmanager
    def transaction(self, handler: str | None) -> Iterator[None]:
        """Time the block as one unit of work of ``handler``, whether or not it raises."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.transaction_seconds.labels(handler or "").observe(time.perf_counter() - started)

    def batch(self, messages: int) -> None:
        """Observe one consumer transaction of ``messages`` deliveries."""
        self.batch_messages.observe(messages)

    def paused(self, reason: PauseReason | None) -> None:
        """Record that consumption paused for ``reason``, or (None) that it resumed."""
        for known in PauseReason:
            self.consumer_paused.labels(known.value).set(1 if known is reason else 0)
        if reason is not None:
            self.consumer_pauses.inc()

    def throttled(self, on: bool) -> None:
        """Record that the consumer slowed down (or returned to full speed)."""
        self.consumer_throttled.set(1 if on else 0)

    def relay_batch(self, rows: int, *, published: int, failed: int = 0, parked: int = 0) -> None:
        """Count one relay batch: ``rows`` claimed, of which ``published`` and ``failed`` (and of
        those, ``parked``). A batch that claimed nothing is not observed."""
        if rows:
            self.relay_batch_rows.observe(rows)
        for result, count in (("published", published), ("failed", failed), ("parked", parked)):
            if count:
                self.relay_messages.labels(result).inc(count)

    def expired(self, count: int) -> None:
        """Count inbox keys the janitor deleted."""
        if count:
            self.inbox_expired.inc(count)

    async def refresh(self, engine: AsyncEngine, *, inbox: bool = True) -> None:
        """Read the gauges from the database: the outbox, and the inbox unless ``inbox`` is False.

        Raises what the database raised (``TimeoutError`` after ``PROBE_TIMEOUT``); the gauges
        then keep their last values.
        """
        async with asyncio.timeout(PROBE_TIMEOUT), engine.connect() as conn:
            outbox = await inspection.outbox_stats(conn)
            gauge = await inspection.inbox_gauge(conn) if inbox else None
        self.outbox_backlog.set(outbox.backlog)
        self.outbox_oldest_age.set(outbox.oldest_age_seconds)
        self.outbox_parked.set(outbox.parked)
        if gauge is not None:
            for status in {*INBOX_STATUSES, *gauge.counts}:
                self.inbox_rows.labels(status).set(gauge.counts.get(status, 0))
            self.inbox_rows_estimated.set(int(gauge.estimated))

    def render(self) -> bytes:
        """Every metric in the Prometheus text format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)
