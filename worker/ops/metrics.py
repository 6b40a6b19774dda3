"""Prometheus metrics and health checks, served on ``/metrics`` and ``/healthz``.

Invariant: an endpoint never waits on PostgreSQL or RabbitMQ. A request is answered from numbers
already in memory; the ``Monitor`` brings the database gauges and the health checks up to date
every few seconds, each probe bounded by a timeout, so a hung database can make ``/healthz``
report a failure but never make it hang, and scraping as often as you like costs no query.

Every metric lives in the ``CollectorRegistry`` of one ``Metrics`` object, never in
prometheus-client's global registry, so several workers (or tests) in one process cannot collide.
Counters and histograms are updated where things happen (consumer, relay, janitor); the gauges
are read from the database by ``Metrics.refresh``.

The HTTP server is a minimal HTTP/1.0 responder on ``asyncio.start_server``: it reads the request
line, skips the headers, answers and closes. No client can pin it: the whole exchange, closing
included, must end within ``REQUEST_TIMEOUT`` or the connection is dropped, and beyond
``http_max_connections`` open connections a new one is closed as it is accepted, unread, so the
process's open files stay bounded whatever a client does. A dropped or refused connection is
logged at debug level only (a refusal also counts in ``worker_http_connections_refused_total``
and in a warning at most once a minute), never with a traceback.

It runs on the worker's event loop, so it needs no thread, no framework and no locking, binds
port 0 to an ephemeral port that tests can read, and closes with the loop's other components.
``wsgiref`` in a daemon thread would serve one client at a time, could not be stopped from the
loop without blocking it, and logs every request to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
from collections import Counter as Tallies
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

from aio_pika.abc import AbstractConnection
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

from worker import database
from worker.backoff import first
from worker.core.outcomes import Outcome
from worker.database import PROBE_TIMEOUT
from worker.errors import PauseReason, Reason, is_transient
from worker.settings import Settings, format_duration
from worker.sql import inspection
from worker.sql.tables import INBOX_STATUSES

log = logging.getLogger(__name__)

RELAY_RESULTS = ("published", "failed", "parked")
"""The ``result`` label of ``worker_relay_messages_total``."""

TRANSACTION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)

REFRESH_INTERVAL = 5.0
"""Seconds between two rounds of health probes and outbox gauges."""

INBOX_INTERVAL = 60.0
"""Seconds between two inbox counts, which read the whole inbox (``inspection.inbox_counts``)."""

REQUEST_TIMEOUT = 5.0
"""Seconds a client has for its whole exchange: send the request, read the answer, close."""

REFUSALS_LOG_INTERVAL = 60.0
"""Seconds between two warnings that connections are being refused."""


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
            "worker_inbox_rows", "Inbox keys by status.", ["status"], registry=r
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
            counts = await inspection.inbox_counts(conn) if inbox else None
        self.outbox_backlog.set(outbox.backlog)
        self.outbox_oldest_age.set(outbox.oldest_age_seconds)
        self.outbox_parked.set(outbox.parked)
        if counts is not None:
            for status in {*INBOX_STATUSES, *counts}:
                self.inbox_rows.labels(status).set(counts.get(status, 0))

    def render(self) -> bytes:
        """Every metric in the Prometheus text format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)


@dataclass
class Health:
    """The latest health probes. ``consuming`` is None in a process that does not consume."""

    database: bool = False
    broker: bool = False
    consuming: bool | None = None
    probed: bool = False
    condition: Callable[[], Mapping[str, object]] | None = None

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
        self.update("database", cause is None, cause)
        # A robust connection stays open while it reconnects: ``connected`` tells the truth.
        self.update("broker", not connection.is_closed and connection.connected.is_set())
        self.update("consuming", None if consuming is None else consuming())
        self.probed = True

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
        checks: dict[str, bool] = {"database": self.database, "broker": self.broker}
        if self.consuming is not None:
            checks["consuming"] = self.consuming
        condition = self.condition() if self.condition is not None else {}
        healthy = self.probed and all(checks.values()) and "paused" not in condition
        status = "ok" if healthy else ("failing" if self.probed else "starting")
        return healthy, {"status": status, **checks, **condition}


class HttpServer:
    """``/metrics`` and ``/healthz`` (GET or HEAD) over HTTP/1.0, one request per connection.

    ``await HttpServer(metrics, health).start(host, port)`` returns the bound port (an ephemeral
    one for port 0); ``close()`` stops listening and drops the connections still open. Also an
    async context manager once started. At most ``max_connections`` are served at once, each
    for at most ``timeout`` seconds.
    """

    def __init__(
        self,
        metrics: Metrics,
        health: Health,
        *,
        max_connections: int = 64,
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.metrics = metrics
        self.health = health
        self.max_connections = max_connections
        self.timeout = timeout
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[Any]] = set()
        self._open = 0
        self._refused = 0
        self._next_warning = 0.0

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port``; returns the port bound."""
        self._server = await asyncio.start_server(self._accept, host, port, limit=16 * 1024)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Stop listening and drop the connections still open."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for client in list(self._clients):
            client.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)
        if server is not None:
            await server.wait_closed()  # from Python 3.12 on, it waits for every connection

    async def __aenter__(self) -> HttpServer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Coroutine[Any, Any, None] | None:
        """Called as a connection is accepted, before anything is read: serve it, or close it at
        once when ``max_connections`` are open."""
        if self._open >= self.max_connections:
            writer.transport.abort()
            self._count_refusal()
            return None
        self._open += 1
        return self._serve(reader, writer)

    def _count_refusal(self) -> None:
        self.metrics.http_refused.inc()
        self._refused += 1
        now = time.monotonic()
        if now < self._next_warning:
            log.debug("http: refused a connection: %d open", self._open)
            return
        log.warning(
            "http: %d connection(s) refused, %d open (http_max_connections)",
            self._refused,
            self._open,
        )
        self._refused, self._next_warning = 0, now + REFUSALS_LOG_INTERVAL

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        try:
            # Closing counts too: a client that reads nothing would keep the answer buffered.
            async with asyncio.timeout(self.timeout):
                request = await reader.readline()
                # Headers are read but ignored: closing with unread input would reset the
                # connection, and the client could lose the answer.
                while (await reader.readline()).strip():
                    pass
                writer.write(self.answer(request))
                await writer.drain()
                writer.close()
                await writer.wait_closed()
        except (TimeoutError, OSError, ValueError) as exc:  # slow, gone, or a line too long
            log.debug("http: dropped a connection: %r", exc)
        except Exception:
            log.exception("http: could not answer a request")
        finally:
            writer.transport.abort()  # nothing left to send: the socket closes now
            self._open -= 1
            self._clients.discard(task)

    def answer(self, request_line: bytes) -> bytes:
        """The whole response to a request line, e.g. ``b"GET /metrics HTTP/1.1"``."""
        parts = request_line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(HTTPStatus.BAD_REQUEST, "text/plain", b"bad request\n")
        method, target, _ = parts
        if method not in {"GET", "HEAD"}:
            return _response(
                HTTPStatus.METHOD_NOT_ALLOWED, "text/plain", b"use GET\n", allow="GET, HEAD"
            )
        path = target.split("?", 1)[0]
        if path == "/metrics":
            status, content_type, body = HTTPStatus.OK, CONTENT_TYPE_LATEST, self.metrics.render()
        elif path == "/healthz":
            healthy, report = self.health.report()
            status = HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE
            content_type, body = "application/json", json.dumps(report).encode() + b"\n"
        else:
            status, content_type, body = HTTPStatus.NOT_FOUND, "text/plain", b"not found\n"
        return _response(status, content_type, body, head=method == "HEAD")


def local_url(host: str, port: int, path: str) -> str:
    """The URL at which this host reaches an endpoint bound to ``host:port``: a wildcard address
    (``0.0.0.0``, ``::``, empty) asks the loopback address of its family, a host name is kept,
    and an IPv6 address is bracketed."""
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if not host or (address is not None and address.is_unspecified):
        host = "::1" if address is not None and address.version == 6 else "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{path}"


def _response(
    status: HTTPStatus, content_type: str, body: bytes, *, head: bool = False, allow: str = ""
) -> bytes:
    lines = [
        f"HTTP/1.0 {status.value} {status.phrase}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Cache-Control: no-store",
        "Connection: close",
    ]
    if allow:
        lines.append(f"Allow: {allow}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else body)


class Monitor:
    """Serves ``/metrics`` and ``/healthz`` and keeps them current until stopped.

    Listens on ``settings.http_host``:``settings.http_port``, no server when that port is 0;
    ``port`` overrides it (0: an ephemeral port, for tests). Every ``interval`` seconds it probes
    health and refreshes the outbox gauges, and the inbox gauges every ``inbox_interval``.
    ``consuming`` (e.g. ``lambda: not consumer.paused``) is left out in a relay-only process.
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
        self.interval = interval
        self.inbox_interval = inbox_interval
        self._port = settings.http_port if port is None else port
        self._serve = port is not None or settings.http_port != 0
        self._server: HttpServer | None = None
        self._inbox_due = 0.0
        self._refresh_failing = False

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
            await server.start(self.settings.http_host, self._port)
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
            return
        now = asyncio.get_running_loop().time()
        inbox = now >= self._inbox_due
        try:
            await self.metrics.refresh(self.engine, inbox=inbox)
        except Exception as exc:
            if is_transient(exc):
                self.health.update("database", False, exc)
            elif not self._refresh_failing:
                log.exception("could not refresh the metrics (logged once until it works again)")
            self._refresh_failing = True
            return
        self._refresh_failing = False
        if inbox:
            self._inbox_due = now + self.inbox_interval
