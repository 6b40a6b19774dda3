"""The ``Sampler``: every ``sample_interval`` seconds a running worker or relay process writes one
row of itself to ``process_samples`` (``worker.sql.samples``): its state and why, its counters
since it started, and the backlogs it sees. ``worker status`` and the console read every
process's state and rates from those rows.

Invariant: sampling never holds up or stops the process. It runs as a task of its own, on the
monitor's one-connection engine (never the consumer's pool); every write and every broker read is
bounded by a timeout; a write that fails (the database down) is logged once and skipped; what it
reads of the message path is a copy of counters and one attribute the consumer stores per batch
(``Consumer.taken``). The queues are counted on a broker connection of the sampler's own
(``worker.transport.connection.Observing``), never the consumer's or the relay's: a count cut
short by its timeout in the middle of a channel's open or close may cost that connection, and it
carries no work. Each write also expires samples older than ``SAMPLES_KEPT``, a bounded batch
at a time, so the table stays as small as the processes' rate of writing makes it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import socket
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from worker.backoff import first
from worker.database import PROBE_TIMEOUT
from worker.logs import describe_error
from worker.settings import Settings
from worker.sql import samples
from worker.sql.inspection import OutboxStats
from worker.sql.samples import Gauge, NewSample
from worker.transport.connection import Observing
from worker.transport.consumer import Consumer
from worker.transport.deliveries import Received
from worker.transport.topology import count_queues

log = logging.getLogger(__name__)

SAMPLES_KEPT = 7200.0
"""Seconds a sample is kept: the console's charts show the last hour, and an hour more is slack
for a process whose clock of writing is late."""

EXPIRE_BATCH = 1000
"""The most old samples one write deletes: far more than the processes write meanwhile."""

QUEUE_TIMEOUT = 2.0
"""Seconds the broker has to answer the passive declares of one sample; past them the queues'
gauges are null in that sample."""

MAX_REASON = 500
"""The most characters of a state's reason a sample keeps."""


class Role(enum.StrEnum):
    """What a process runs: ``worker run`` (consumer, and relay and janitor unless off) or
    ``worker relay`` (a relay alone)."""

    WORKER = "worker"
    RELAY = "relay"


class State(enum.StrEnum):
    """What a process was doing when it wrote a sample."""

    STARTING = "starting"
    """Connected, not yet consuming (or relaying)."""
    CONSUMING = "consuming"
    """Taking deliveries at full speed."""
    PAUSED = "paused"
    """Taking nothing while PostgreSQL is unreachable or the deployment does not match the code
    (the reason says which, and how)."""
    THROTTLED = "throttled"
    """Taking one message at a time after dead letters in a row."""
    DISCONNECTED = "disconnected"
    """Not attached to the work queue, though not paused: its broker connection is being
    restored."""
    RELAYING = "relaying"
    """A relay-only process, relaying."""
    DRAINING = "draining"
    """Stopping: taking nothing more, letting what is in flight commit."""
    STOPPED = "stopped"
    """Stopped: its last sample (it runs no more)."""


THROTTLED_BECAUSE = "one message at a time after dead letters in a row"


def state_of(
    *,
    running: bool,
    draining: bool,
    stopped: bool,
    failed: bool = False,
    condition: Mapping[str, object] | None,
    attached: bool,
) -> tuple[State, str | None]:
    """(state, reason) of a process: ``running`` once its components run, ``draining`` once it
    stops, ``stopped`` (``failed``: because a component failed) at its end; ``condition`` is the
    consumer's (``Consumer.condition``: ``paused``, ``paused_because``, ``throttled``), None in a
    relay-only process; ``attached``, whether the consumer is attached to the work queue."""
    if stopped:
        return State.STOPPED, "a component failed (see its log)" if failed else None
    if draining:
        return State.DRAINING, None
    if not running:
        return State.STARTING, None
    if condition is None:
        return State.RELAYING, None
    if paused := condition.get("paused"):
        because = condition.get("paused_because")
        return State.PAUSED, f"{paused}: {because}" if because else str(paused)
    if condition.get("throttled"):
        return State.THROTTLED, THROTTLED_BECAUSE
    if not attached:
        return State.DISCONNECTED, "no consumer on the work queue: the broker connection is lost"
    return State.CONSUMING, None


def newest_timestamp(taken: Sequence[Received]) -> datetime | None:
    """The timestamp property of the last delivery of ``taken`` that carries one (a timezone-
    naive one is taken as UTC); None when none does. A message's properties are anyone's: only
    a ``datetime`` counts."""
    for message in reversed(taken):
        stamp = message.timestamp
        if isinstance(stamp, datetime):
            return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)
    return None


def outbox_gauges(stats: OutboxStats | None) -> dict[str, float | None]:
    """The outbox's gauges of a sample, from the monitor's last read (all null when it failed)."""
    if stats is None:
        return dict.fromkeys(
            (
                Gauge.OUTBOX_BACKLOG,
                Gauge.OUTBOX_OLDEST_AGE,
                Gauge.OUTBOX_BACKING_OFF,
                Gauge.OUTBOX_PARKED,
                Gauge.OUTBOX_SCHEDULED,
            )
        )
    return {
        Gauge.OUTBOX_BACKLOG: stats.backlog,
        Gauge.OUTBOX_OLDEST_AGE: round(stats.oldest_age_seconds, 3),
        Gauge.OUTBOX_BACKING_OFF: stats.waiting_for_retry,
        Gauge.OUTBOX_PARKED: stats.parked,
        Gauge.OUTBOX_SCHEDULED: stats.scheduled,
    }


class Sampler:
    """Writes a sample of this process every ``settings.sample_interval`` seconds while it runs
    (a supervised component), one when it starts to drain (``drain``) and a last one when it
    stops (``stop``).

    ``stats`` are the process's counters (``Telemetry.stats``); ``outbox`` gives the monitor's
    last read of the outbox (None when it failed); ``consumer`` is None in a relay-only process.
    Samples are written with ``engine`` (the monitor's) and the queues are asked about on
    ``broker``, an observers' connection that carries no work.
    """

    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine,
        broker: Observing,
        stats: Counter[str],
        *,
        role: Role,
        outbox: Callable[[], OutboxStats | None],
        consumer: Consumer | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.broker = broker
        self.stats = stats
        self.role = role
        self.outbox = outbox
        self.consumer = consumer
        self.interval = settings.sample_interval
        self.host = socket.gethostname()[:255]
        self.pid = os.getpid()
        self.process = f"{self.host}:{self.pid}:{datetime.now(UTC).strftime('%Y%m%dT%H%M%S.%fZ')}"
        """Unique per run of a process: its host, pid and when it started (to the microsecond:
        two runs in one process, as in tests, are two processes)."""
        self.started_at: datetime | None = None
        self._running = False
        self._draining = False
        self._writing = asyncio.Lock()
        self._failing = False
        self._drained: asyncio.Task[None] | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Write a sample now and every interval until ``stop`` is set; never raises for a
        failed write."""
        self._running = True
        while not stop.is_set():
            await self.sample()
            await first(stop.wait(), within=self.interval)

    def drain(self) -> None:
        """The process starts to drain: every sample from now on says so, and one is written
        now, without making the drain wait for it."""
        self._draining = True
        self._drained = asyncio.create_task(self.sample(), name="draining sample")

    async def stop(self, *, failed: bool = False) -> None:
        """Write the last sample, ``stopped`` (``failed``: because a component failed), so that
        nobody takes the process for running until its samples age out."""
        if self._drained is not None:
            await asyncio.gather(self._drained, return_exceptions=True)
        await self.sample(stopped=True, failed=failed)

    def state(self, *, stopped: bool = False, failed: bool = False) -> tuple[State, str | None]:
        """This process's state and reason now."""
        consumer = self.consumer
        state, reason = state_of(
            running=self._running,
            draining=self._draining,
            stopped=stopped,
            failed=failed,
            condition=None if consumer is None else consumer.condition(),
            attached=consumer is not None and consumer.consuming,
        )
        return state, None if reason is None else reason[:MAX_REASON]

    async def sample(self, *, stopped: bool = False, failed: bool = False) -> None:
        """Write one sample now (one at a time); a failure is logged once until a write works
        again, never raised."""
        async with self._writing:
            state, reason = self.state(stopped=stopped, failed=failed)
            try:
                gauges = outbox_gauges(self.outbox()) | await self._queue_gauges()
                head = self._queue_head(gauges)
                sample = NewSample(
                    process=self.process,
                    role=self.role.value,
                    host=self.host,
                    pid=self.pid,
                    started_at=self.started_at,
                    state=state.value,
                    reason=reason,
                    counters={str(name): int(count) for name, count in self.stats.items()},
                    gauges=gauges,
                    head_timestamp=head,
                )
                async with asyncio.timeout(PROBE_TIMEOUT), self.engine.begin() as conn:
                    self.started_at = await samples.insert_sample(conn, sample)
                    await samples.expire_samples(conn, kept=SAMPLES_KEPT, limit=EXPIRE_BATCH)
            except Exception as exc:
                if not self._failing:
                    log.warning(
                        "could not write a sample of this process (logged once until a write "
                        "works again): %s",
                        describe_error(exc),
                    )
                self._failing = True
                return
            if self._failing:
                log.info("samples of this process are written again")
            self._failing = False

    async def _queue_gauges(self) -> dict[str, float | None]:
        """The work queue's and the DLQ's ready messages (null when missing or unanswered)."""
        gauges: dict[str, float | None] = {Gauge.WORK_QUEUE: None, Gauge.DEAD_LETTER_QUEUE: None}
        try:
            async with asyncio.timeout(QUEUE_TIMEOUT):
                connection = await self.broker.get(within=QUEUE_TIMEOUT)
                if connection.is_closed or not connection.connected.is_set():
                    return gauges  # (reconnecting: it does so by itself)
                work, dead = await count_queues(
                    connection, [self.settings.queue, self.settings.dead_letter_queue]
                )
            gauges[Gauge.WORK_QUEUE] = None if work is None else work.messages
            gauges[Gauge.DEAD_LETTER_QUEUE] = None if dead is None else dead.messages
        except Exception as exc:
            log.debug("could not count the queues for a sample: %s", describe_error(exc))
        return gauges

    def _queue_head(self, gauges: dict[str, float | None]) -> datetime | None:
        """The timestamp whose age is ``Gauge.QUEUE_LAG`` (the database measures it at the
        write), or None with the lag set in ``gauges``: 0 when no message is ready (nothing
        waits), null when unknown (no consumer, or no timestamp on the last batch taken). While
        messages are ready and none is taken (paused), the age keeps growing: it is then an
        upper bound of the head's (the last one taken is older than the ones behind it)."""
        gauges[Gauge.QUEUE_LAG] = None
        if self.consumer is None:
            return None
        if gauges.get(Gauge.WORK_QUEUE) == 0:
            gauges[Gauge.QUEUE_LAG] = 0.0
            return None
        return newest_timestamp(self.consumer.taken)
