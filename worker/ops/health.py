"""Health checks for ``/healthz`` (``/readyz``) and ``/livez``, and the ``Monitor`` that keeps
them and the gauges current.

Invariant: an endpoint never waits on PostgreSQL or RabbitMQ. A request is answered from numbers
already in memory; the ``Monitor`` brings the database gauges and the health checks up to date
every few seconds, each probe bounded by a timeout, so a hung database can make ``/healthz``
report a failure but never make it hang, and scraping as often as you like costs no query.

Two questions, two answers: ``/healthz`` (alias ``/readyz``) says whether the process does its
work now, and is 503 while it waits out an outage (paused, reconnecting); ``/livez`` says only
whether the process is stuck, and never depends on PostgreSQL or the broker being up, so an
orchestrator that restarts on it does not restart a worker that is correctly paused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from aio_pika.abc import AbstractConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import database
from worker.backoff import first
from worker.errors import ConfigurationError, is_transient
from worker.ops.http import HttpServer
from worker.ops.metrics import Metrics
from worker.settings import Settings, format_duration
from worker.sql.inspection import OutboxStats

log = logging.getLogger("worker.ops.metrics")  # the health lines, under the logger they had

REFRESH_INTERVAL = 5.0
"""Seconds between two rounds of health probes and outbox gauges."""

INBOX_INTERVAL = 60.0
"""Seconds between two inbox gauges (``inspection.inbox_gauge``: it reads the whole inbox only
while the inbox is small)."""

SINCE_WHEN = ("paused", "throttled")
"""The consumer's conditions whose start ``/healthz`` shows as ``<condition>_since``."""

STUCK_AFTER = 60.0
"""Seconds without a finished probe after which ``/livez`` reports the process stuck. A round of
the monitor takes at most two ``database.PROBE_TIMEOUT`` (5 s each) beyond ``REFRESH_INTERVAL``
whatever PostgreSQL and the broker do, so only a blocked event loop or a dead monitor gets here."""


@dataclass
class Health:
    """The latest health probes. ``consuming`` is None in a process that does not consume."""

    database: bool = False
    broker: bool = False
    consuming: bool | None = None
    probed: bool = False
    condition: Callable[[], Mapping[str, object]] | None = None
    probed_at: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when the last probe finished (before the first: when this was made)."""
    database_failure: Exception | None = None
    """What the last probe of PostgreSQL raised, if it failed."""
    connection: AbstractConnection | None = None
    """The broker connection probed: ``report`` reads whether it is up as it answers (from
    memory), so a lost connection shows at once, not at the next probe."""
    since: dict[str, tuple[object, str]] = field(default_factory=dict)
    """Each of the consumer's conditions that holds now (``paused``, ``throttled``): its value
    and when it was first seen so (ISO 8601, UTC), within a probe's interval."""

    async def probe(
        self,
        engine: AsyncEngine,
        connection: AbstractConnection,
        consuming: Callable[[], bool] | None = None,
    ) -> None:
        """Probe PostgreSQL (``SELECT 1`` within ``PROBE_TIMEOUT``), the broker connection and,
        given ``consuming``, whether the consumer is attached; log what changed."""
        cause: Exception | None = None
        try:
            await database.probe(engine)
        except Exception as exc:
            cause = exc
        self.database_failure = cause
        self.update("database", cause is None, cause)
        self.connection = connection
        self.update("broker", _up(connection))
        self.update("consuming", None if consuming is None else consuming())
        self.observed()
        self.probed = True
        self.probed_at = time.monotonic()

    def update(
        self,
        check: Literal["database", "broker", "consuming"],
        ok: bool | None,
        cause: object = None,
    ) -> None:
        """Record one check's result; log it when it starts failing (with ``cause``) or recovers."""
        before = getattr(self, check)
        if ok is False and (before or not self.probed):
            suffix = f": {cause!r}" if cause is not None else ""
            log.warning("health: %s failing%s", check, suffix)
        elif ok and not before and self.probed:
            log.info("health: %s ok again", check)
        setattr(self, check, ok)

    def report(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, the ``/healthz`` JSON): every check true, after at least one probe; with
        the consumer's ``condition`` (why it is paused, whether it is throttled) when known."""
        broker = self.broker if self.connection is None else _up(self.connection)
        checks: dict[str, bool] = {"database": self.database, "broker": broker}
        if self.consuming is not None:
            checks["consuming"] = self.consuming
        condition = self.observed()
        healthy = self.probed and all(checks.values()) and "paused" not in condition
        status = "ok" if healthy else ("failing" if self.probed else "starting")
        return healthy, {"status": status, **checks, **condition}

    def observed(self) -> dict[str, object]:
        """The consumer's ``condition`` now, with ``<condition>_since`` for each of
        ``SINCE_WHEN`` that holds (whatever paused it: a database outage, a deployment fault,
        a silent network path), recorded as soon as a probe or a request first sees it."""
        condition = dict(self.condition()) if self.condition is not None else {}
        for name in SINCE_WHEN:
            value = condition.get(name)
            if value in (None, False):
                self.since.pop(name, None)
            elif self.since.get(name, (None,))[0] != value:
                self.since[name] = (value, datetime.now(UTC).isoformat(timespec="seconds"))
        return condition | {f"{name}_since": when for name, (_, when) in self.since.items()}

    def liveness(self, stuck_after: float = STUCK_AFTER) -> tuple[bool, dict[str, Any]]:
        """(alive, the ``/livez`` JSON): alive while a probe finished within ``stuck_after``
        seconds, whatever it found. Answering at all proves the event loop runs; a recent probe
        proves the monitor does too."""
        age = time.monotonic() - self.probed_at
        alive = age < stuck_after
        return alive, {"status": "alive" if alive else "stuck", "probed_seconds_ago": round(age, 1)}


def _up(connection: AbstractConnection) -> bool:
    """Whether ``connection`` is connected now (a robust connection stays open while it
    reconnects: ``connected`` tells the truth)."""
    return not connection.is_closed and connection.connected.is_set()


class Monitor:
    """Serves ``/metrics`` and ``/healthz`` and keeps them current until stopped.

    Listens on ``settings.http_host``:``settings.http_port``, no server when that port is 0;
    ``port`` overrides it (0: an ephemeral port, for tests). Every ``interval`` seconds it probes
    health and refreshes the outbox gauges, and the inbox gauges every ``inbox_interval``.
    ``consuming`` (e.g. ``lambda: not consumer.paused``) is left out in a relay-only process.
    ``database_unreachable`` is told why each time a probe finds PostgreSQL unreachable (the
    consumer pauses on it), so a silent network path shows within one round and a probe.
    """

    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine,
        connection: AbstractConnection,
        metrics: Metrics,
        *,
        consuming: Callable[[], bool] | None = None,
        condition: Callable[[], Mapping[str, object]] | None = None,
        database_unreachable: Callable[[str], None] | None = None,
        port: int | None = None,
        interval: float = REFRESH_INTERVAL,
        inbox_interval: float = INBOX_INTERVAL,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.connection = connection
        self.metrics = metrics
        self.health = Health(condition=condition)
        self.consuming = consuming
        self.database_unreachable = database_unreachable
        self.interval = interval
        self.inbox_interval = inbox_interval
        self._port = settings.http_port if port is None else port
        self._serve = port is not None or settings.http_port != 0
        self._server: HttpServer | None = None
        self._inbox_due = 0.0
        self._refresh_failing = False
        self.outbox: OutboxStats | None = None
        """The outbox as the last round read it; None when that round could not (the
        process's samples show it)."""

    @property
    def port(self) -> int | None:
        """The port the server listens on, once started; None without a server."""
        return None if self._server is None else self._server.port

    async def start(self) -> int | None:
        """Start the HTTP server (unless it is off or running); returns its port."""
        if self._serve and self._server is None:
            server = HttpServer(
                self.metrics, self.health, max_connections=self.settings.http_max_connections
            )
            try:
                await server.start(self.settings.http_host, self._port)
            except OSError as exc:
                raise ConfigurationError(
                    f"cannot serve /healthz and /metrics on {self.settings.http_host}:"
                    f"{self._port} ({exc.strerror or exc}): another process listens there, or "
                    "the address is not this host's; set WORKER_HTTP_PORT (--http-port) or "
                    "WORKER_HTTP_HOST (--http-host)"
                ) from exc
            self._server = server
            log.info("serving /metrics and /healthz on %s:%d", self.settings.http_host, server.port)
        return self.port

    async def close(self) -> None:
        """Stop the HTTP server."""
        if self._server is not None:
            server, self._server = self._server, None
            await server.close()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve, and probe and refresh now and then every ``interval``, until ``stop`` is set."""
        await self.start()
        log.debug(
            "refreshing health every %s, inbox counts every %s",
            format_duration(self.interval),
            format_duration(self.inbox_interval),
        )
        try:
            while not stop.is_set():
                await self.check()
                await first(stop.wait(), within=self.interval)
        finally:
            await self.close()

    async def check(self) -> None:
        """One round: probe health, then refresh the gauges if the database answered.

        A transient database error marks the database failing; any other error is logged (once
        until a refresh works again). Neither stops the monitor: the gauges keep their last
        values.
        """
        await self.health.probe(self.engine, self.connection, self.consuming)
        if not self.health.database:
            self.outbox = None
            failure = self.health.database_failure
            if self.database_unreachable is not None and failure is not None:
                self.database_unreachable(database.unreachable(failure))
            return
        now = asyncio.get_running_loop().time()
        inbox = now >= self._inbox_due
        try:
            self.outbox = await self.metrics.refresh(self.engine, inbox=inbox)
        except Exception as exc:
            self.outbox = None
            if is_transient(exc):
                self.health.update("database", False, exc)
            elif not self._refresh_failing:
                log.exception("could not refresh the metrics (logged once until it works again)")
            self._refresh_failing = True
            return
        self._refresh_failing = False
        if inbox:
            self._inbox_due = now + self.inbox_interval
