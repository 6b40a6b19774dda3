"""What the message path counts and times: one closed set of counters (``Count``), recorded one
way (``Telemetry.count``, and ``Tally.record`` for how a delivery ended), in memory only.

Invariant: each counter is declared once, in ``Count``; that declaration gives both its name in
``stats`` (what the stats log line and tests read) and the Prometheus counter it feeds, if any, so
the two cannot disagree. Every metric lives in the ``CollectorRegistry`` of one ``Telemetry``,
never in prometheus-client's global registry, so several workers (or tests) in one process cannot
collide. ``ops.metrics.Metrics`` adds what only operators read (the database's gauges,
``/metrics``).
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections import Counter as Tallies
from collections.abc import Iterable, Iterator
from typing import NamedTuple, Self

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from worker.core.outcomes import Outcome
from worker.errors import PauseReason, Reason

__all__ = ["Count", "Exported", "Tally", "Telemetry", "dead_lettered_because"]

TRANSACTION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class Exported(NamedTuple):
    """The Prometheus counter a ``Count`` feeds: its name, help, and the ``(label, value)`` the
    count is under when the counter has one."""

    metric: str
    help: str
    label: tuple[str, str] | None = None


_RELAY = "worker_relay_messages_total"
_RELAY_HELP = "Outbox rows by publish result; failed rows are retried, parked ones gave up."


class Count(enum.StrEnum):
    """Every counter in ``stats``, each with the Prometheus counter it feeds (``export``).

    How a delivery ended (the ``Outcome`` members) is exported by ``Tally`` per handler, in
    ``worker_messages_total``; a dead letter's reason also counts under
    ``dead_lettered_because(reason)``.
    """

    export: Exported | None

    def __new__(cls, name: str, export: Exported | None = None) -> Self:
        member = str.__new__(cls, name)
        member._value_ = name
        member.export = export
        return member

    PROCESSED = Outcome.PROCESSED.value
    DUPLICATE = Outcome.DUPLICATE.value
    DUPLICATE_OF_FAILED = Outcome.DUPLICATE_OF_FAILED.value
    WAITING = Outcome.WAITING.value
    RETRY_SCHEDULED = Outcome.RETRY_SCHEDULED.value
    DEAD_LETTERED = Outcome.DEAD_LETTERED.value
    REQUEUED = Outcome.REQUEUED.value
    REJECTED_TO_BROKER = "rejected_to_broker"
    """A DLQ copy that could not be published: dead-lettered by the broker instead."""
    PAUSED = (
        "paused",
        Exported(
            "worker_consumer_pauses_total",
            "Times consumption paused because PostgreSQL was unreachable or the deployment "
            "(schema, privileges) did not match the code.",
        ),
    )
    """Times consumption paused for a database outage or a deployment fault."""
    THROTTLED = "throttled"
    """Times the consumer slowed down after consecutive dead letters."""
    BATCHES = "batches"
    """Transactions of several deliveries that committed."""
    MULTIPLE_ACKS = "multiple_acks"
    """Acks sent with ``multiple=True``."""
    ISOLATED = "isolated"
    """Deliveries whose handler failed in a batch, taken out while the rest committed."""
    BATCH_RETRIED_ALONE = "batch_retried_alone"
    """Batches that failed as a whole and were redone one delivery per transaction."""
    RELAY_PUBLISHED = "relay_published", Exported(_RELAY, _RELAY_HELP, ("result", "published"))
    """Outbox rows published and deleted."""
    RELAY_FAILED = "relay_failed", Exported(_RELAY, _RELAY_HELP, ("result", "failed"))
    """Outbox rows whose publish failed (returned, nacked or unpublishable), to be retried."""
    RELAY_PARKED = "relay_parked", Exported(_RELAY, _RELAY_HELP, ("result", "parked"))
    """Outbox rows the relay gave up on (of the failed ones)."""
    SCHEDULED_DUE = (
        "scheduled_due",
        Exported(
            "worker_outbox_scheduled_due_total",
            "Scheduled events moved into the outbox by the relay when they fell due.",
        ),
    )
    """Scheduled events the relay moved into the outbox once the database's clock said due."""
    INBOX_EXPIRED = (
        "inbox_expired",
        Exported(
            "worker_inbox_expired_total", "Inbox keys deleted by the janitor after their retention."
        ),
    )
    """Inbox keys the janitor deleted."""
    INGRESS_REQUESTS_EXPIRED = "ingress_requests_expired"
    """Ingress requests the janitor deleted."""


def dead_lettered_because(reason: Reason) -> str:
    """The ``stats`` name counting dead letters parked for ``reason``."""
    return f"{Count.DEAD_LETTERED}:{reason.value}"


class Tally:
    """How deliveries ended, each counted once, in one place: ``record``.

    Invariant: ``/metrics`` (``worker_messages_total`` by handler and outcome,
    ``worker_dead_letters_total`` by handler and reason) and ``stats`` (``Count``) are both
    written by the one ``record`` call a delivery's end makes, so they cannot disagree.
    """

    def __init__(self, stats: Tallies[str]) -> None:
        self.stats = stats
        self._ends: Tallies[tuple[str, Outcome, Reason | None]] = Tallies()

    def record(self, handler: str | None, outcome: Outcome, reason: Reason | None = None) -> None:
        """Count one delivery of ``handler`` (None: none was found) that ended with ``outcome``;
        a dead letter, and only a dead letter, has a ``reason``."""
        if (outcome is Outcome.DEAD_LETTERED) != (reason is not None):
            raise ValueError(f"a dead letter, and only a dead letter, has a reason: {outcome}")
        self._ends[(handler or "", outcome, reason)] += 1
        self.stats[outcome.value] += 1
        if reason is not None:
            self.stats[dead_lettered_because(reason)] += 1

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


def _exported_counters(registry: CollectorRegistry) -> dict[Count, Counter]:
    """One Prometheus counter per ``Exported.metric`` of ``Count``, each label value created (so
    it reads 0 before it counts); for each count that feeds one, the counter (or its child)."""
    families: dict[str, Counter] = {}
    fed: dict[Count, Counter] = {}
    for count in Count:
        if count.export is None:
            continue
        metric, help_text, label = count.export
        if metric not in families:
            families[metric] = Counter(
                metric, help_text, [label[0]] if label else [], registry=registry
            )
        fed[count] = families[metric].labels(label[1]) if label else families[metric]
    return fed


class Telemetry:
    """The message path's counters, histograms and gauges, in a registry of their own
    (``registry``), counting into ``stats`` (a new ``Counter`` by default).

    ``handler`` is a handler's name, or None when none was found (the label is then empty).
    """

    def __init__(self, stats: Tallies[str] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.stats: Tallies[str] = Tallies() if stats is None else stats
        self.tally = Tally(self.stats)
        self.registry.register(self.tally)
        self._exported = _exported_counters(self.registry)
        self.transaction_seconds = Histogram(
            "worker_transaction_seconds",
            "Duration of a unit of work (one transaction, or a workflow's run), failed ones too.",
            ["handler"],
            buckets=TRANSACTION_BUCKETS,
            registry=self.registry,
        )
        self.batch_messages = Histogram(
            "worker_batch_messages",
            "Deliveries per consumer transaction (a batch); one for a message handled alone.",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.relay_batch_rows = Histogram(
            "worker_relay_batch_rows",
            "Outbox rows claimed per relay batch (batches that claimed at least one).",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.consumer_paused = Gauge(
            "worker_consumer_paused",
            "1 while consumption is paused, by why: database-unreachable or deployment.",
            ["reason"],
            registry=self.registry,
        )
        self.consumer_throttled = Gauge(
            "worker_consumer_throttled",
            "1 while the consumer takes one message at a time after consecutive dead letters.",
            registry=self.registry,
        )
        self.paused(None)

    def count(self, count: Count, amount: int = 1) -> None:
        """Add ``amount`` to ``count``, in ``stats`` and in the Prometheus counter it feeds."""
        if not amount:
            return
        if count.value in {outcome.value for outcome in Outcome}:
            raise ValueError(f"count how a delivery ended with tally.record, not {count}")
        self.stats[count.value] += amount
        if (exported := self._exported.get(count)) is not None:
            exported.inc(amount)

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
            self.count(Count.PAUSED)

    def throttled(self, on: bool) -> None:
        """Record that the consumer slowed down (counted once) or returned to full speed."""
        if on:
            self.count(Count.THROTTLED)
        self.consumer_throttled.set(1 if on else 0)

    def relay_batch(self, rows: int, *, published: int, failed: int = 0, parked: int = 0) -> None:
        """Count one relay batch: ``rows`` claimed, of which ``published`` and ``failed`` (and of
        those, ``parked``). A batch that claimed nothing is not observed."""
        if rows:
            self.relay_batch_rows.observe(rows)
        self.count(Count.RELAY_PUBLISHED, published)
        self.count(Count.RELAY_FAILED, failed)
        self.count(Count.RELAY_PARKED, parked)

    def expired(self, count: int, requests: int = 0) -> None:
        """Count inbox keys (and ingress requests) the janitor deleted."""
        self.count(Count.INBOX_EXPIRED, count)
        self.count(Count.INGRESS_REQUESTS_EXPIRED, requests)
