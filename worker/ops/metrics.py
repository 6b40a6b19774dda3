"""Prometheus metrics, served on ``/metrics`` (by ``http.HttpServer``).

Invariant: every metric lives in the ``CollectorRegistry`` of one ``Metrics`` object, never in
prometheus-client's global registry, and rendering reads numbers already in memory only. What the
message path counts is declared in ``worker.telemetry`` (``Count``, ``Tally``); this module adds the
gauges read from the database by ``Metrics.refresh`` and the HTTP server's own counter.
"""

from __future__ import annotations

import asyncio
from collections import Counter as Tallies

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.database import PROBE_TIMEOUT
from worker.sql import inspection
from worker.sql.tables import INBOX_STATUSES
from worker.telemetry import Telemetry

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]


class Metrics(Telemetry):
    """The message path's ``Telemetry`` and what operators read beside it: the outbox's and the
    inbox's gauges (``refresh``) and the refused HTTP connections, in the same registry."""

    def __init__(self, stats: Tallies[str] | None = None) -> None:
        super().__init__(stats)
        r = self.registry
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
        self.outbox_scheduled = Gauge(
            "worker_outbox_scheduled",
            "Events scheduled for later, waiting in outbox_scheduled for their due time; "
            f"estimated from PostgreSQL's statistics above "
            f"{inspection.EXACT_SCHEDULED_COUNT_LIMIT:,} rows.",
            registry=r,
        )
        self.outbox_scheduled_overdue = Gauge(
            "worker_outbox_scheduled_overdue_seconds",
            "How long the earliest due scheduled event has waited for a relay to move it into "
            "the outbox; 0 when none is due.",
            registry=r,
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
        for status in INBOX_STATUSES:
            self.inbox_rows.labels(status)

    async def refresh(self, engine: AsyncEngine, *, inbox: bool = True) -> inspection.OutboxStats:
        """Read the gauges from the database: the outbox (returned, as read), and the inbox
        unless ``inbox`` is False.

        Raises what the database raised (``TimeoutError`` after ``PROBE_TIMEOUT``); the gauges
        then keep their last values.
        """
        async with asyncio.timeout(PROBE_TIMEOUT), engine.connect() as conn:
            outbox = await inspection.outbox_stats(conn)
            gauge = await inspection.inbox_gauge(conn) if inbox else None
        self.outbox_backlog.set(outbox.backlog)
        self.outbox_oldest_age.set(outbox.oldest_age_seconds)
        self.outbox_parked.set(outbox.parked)
        self.outbox_scheduled.set(outbox.scheduled)
        self.outbox_scheduled_overdue.set(outbox.scheduled_overdue_seconds)
        if gauge is not None:
            for status in {*INBOX_STATUSES, *gauge.counts}:
                self.inbox_rows.labels(status).set(gauge.counts.get(status, 0))
            self.inbox_rows_estimated.set(int(gauge.estimated))
        return outbox

    def render(self) -> bytes:
        """Every metric in the Prometheus text format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)
