"""What ``worker status`` and ``worker outbox`` show and do, for a person at a terminal.

Looking never changes anything: ``status`` reads the database (every process's latest samples
included) in one read-only snapshot and asks the broker about the worker's queues with passive
declares only, so a queue no worker has
declared yet is reported missing, never created; ``outbox_list`` shows unpublished events in
every state and changes none. The writes are ``retry_outbox``, which in one transaction makes
backing-off rows due now and moves parked rows back into ``outbox`` under their own
``message_id``, so a consumer that already got a copy deduplicates the next one, and
``cancel_outbox``, which takes unpublished events back (``worker.sql.outbox.cancel``) in one
transaction. Each part of
``status`` fails on its own: an unreachable PostgreSQL still leaves the broker's part, and the
reverse.

The outbox's reading and writing are functions of an engine (``read_outbox``,
``retry_outbox_rows``, ``cancel_outbox_events``), which the console calls on its own engine;
the functions of ``Settings`` beside them run the same on a one-connection engine for the CLI,
so both follow one set of rules.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from aio_pika.abc import AbstractConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.database import one_connection
from worker.errors import (
    AccessRefused,
    ConfigurationError,
    Fault,
    Service,
    cannot_reach,
    classify,
    innermost,
    refusal,
)
from worker.liveness import Liveness
from worker.logs import describe_error
from worker.ops.http import local_url
from worker.ops.overview import ProcessView, read_processes
from worker.settings import Settings, format_duration
from worker.sql import inspection, outbox
from worker.sql.tables import INBOX_STATUSES
from worker.transport.connection import connect
from worker.transport.topology import count_queues, worker_queues

STATUS_TIMEOUT = 10.0
"""Seconds each part of ``status`` (database, broker) may take before it counts as unreachable."""

APPLICATION_NAME = "worker-admin"

_T = TypeVar("_T")


@dataclass(frozen=True)
class QueueStatus:
    """One of the worker's queues as the broker reports it on a passive declare.

    ``messages`` counts the ready messages, not those delivered and unacked, and can lag behind
    messages just returned to the queue; both counts are None when the queue does not exist.
    """

    role: str
    name: str
    exists: bool
    messages: int | None
    consumers: int | None


@dataclass(frozen=True)
class OutboxStatus:
    """Rows waiting to be published, the age of the oldest (None when there is none), how many
    of them back off after a failed publish, the rows parked in ``outbox_parked``, and the
    events scheduled for later (``inspection.OutboxStats``: an estimate when
    ``scheduled_estimated``; ``scheduled_overdue_seconds`` 0 unless one is due and not moved)."""

    backlog: int
    oldest_age_seconds: float | None
    waiting_for_retry: int
    parked: int
    scheduled: int
    scheduled_estimated: bool
    scheduled_overdue_seconds: float


@dataclass(frozen=True)
class WorkflowStatus:
    """Workflows in progress, how many of them wait for a signal or a deadline, and the one
    least recently advanced that is not waiting (a waiting one holds nothing on purpose): the
    likeliest to be stuck."""

    in_progress: int
    oldest: inspection.WorkflowState | None
    waiting: int = 0


@dataclass(frozen=True)
class DatabaseStatus:
    """The outbox, inbox keys by status and workflows, read in one snapshot."""

    outbox: OutboxStatus
    inbox: dict[str, int]
    workflows: WorkflowStatus


@dataclass(frozen=True)
class ProcessStatus:
    """What the worker process on this host says of itself at ``url`` (its ``/healthz``):
    ``health`` is that JSON (``status``, the checks, ``paused`` and ``paused_since``,
    ``throttled`` and ``throttled_since``), or None with ``error`` when it does not answer."""

    url: str
    health: dict[str, Any] | None
    error: str | None = None


@dataclass(frozen=True)
class Status:
    """``worker status``: a part is None when its service could not be read, and ``errors``
    then says why, by part (``database``, ``broker``); ``process`` is None when this host
    serves no ``/healthz`` (``http_port`` 0); ``processes`` are every worker and relay process
    that wrote a sample lately (``overview.read_processes``), None when the database could not
    be read."""

    queues: list[QueueStatus] | None
    database: DatabaseStatus | None
    errors: dict[str, str]
    process: ProcessStatus | None = None
    processes: list[ProcessView] | None = None


async def local_process(settings: Settings, *, within: float) -> ProcessStatus | None:
    """Ask the worker on this host (``http_host``:``http_port``) how it is, as ``worker
    health`` does: a paused or throttled consumer says why and since when; None when the
    port is 0."""
    if settings.http_port == 0:
        return None
    url = local_url(settings.http_host, settings.http_port, "/healthz")

    def get() -> ProcessStatus:
        try:
            with urllib.request.urlopen(url, timeout=within) as response:
                body = response.read()
        except urllib.error.HTTPError as error:  # (503: failing or paused; its body says why)
            body = error.read()
        except OSError as exc:
            return ProcessStatus(url, None, f"no answer ({describe_error(exc)})")
        try:
            health = json.loads(body)
        except ValueError:
            return ProcessStatus(url, None, "the answer is not JSON")
        return ProcessStatus(url, health if isinstance(health, dict) else None)

    return await asyncio.to_thread(get)


async def queue_status(connection: AbstractConnection, settings: Settings) -> list[QueueStatus]:
    """Message and consumer counts of the worker's queues, by passive declares
    (``topology.count_queues``)."""
    queues = worker_queues(settings)
    counts = await count_queues(connection, [name for _, name in queues])
    return [
        QueueStatus(role, name, exists=False, messages=None, consumers=None)
        if found is None
        else QueueStatus(
            role, name, exists=True, messages=found.messages, consumers=found.consumers
        )
        for (role, name), found in zip(queues, counts, strict=True)
    ]


async def database_status(
    engine: AsyncEngine, *, sample_interval: float
) -> tuple[DatabaseStatus, list[ProcessView]]:
    """The outbox, the inbox and the workflows, and every process seen lately (by a reader whose
    ``sample_interval`` this is: ``overview.read_processes``), in one read-only ``REPEATABLE
    READ`` snapshot, so the numbers agree with each other and ages are measured against one
    ``now()``."""
    snapshot = engine.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
    async with snapshot.begin() as conn:
        stats = await inspection.outbox_stats(conn)
        inbox = dict.fromkeys(INBOX_STATUSES, 0) | await inspection.inbox_counts(conn)
        oldest = await inspection.in_progress_workflows(conn, 1, waiting=False)
        waiting = await inspection.waiting_workflows(conn)
        processes = await read_processes(conn, interval=sample_interval)
    database = DatabaseStatus(
        outbox=OutboxStatus(
            backlog=stats.backlog,
            oldest_age_seconds=stats.oldest_age_seconds if stats.backlog else None,
            waiting_for_retry=stats.waiting_for_retry,
            parked=stats.parked,
            scheduled=stats.scheduled,
            scheduled_estimated=stats.scheduled_estimated,
            scheduled_overdue_seconds=stats.scheduled_overdue_seconds,
        ),
        inbox=inbox,
        # Between steps a workflow's key is the only committed in_progress inbox row there is.
        workflows=WorkflowStatus(inbox["in_progress"], oldest[0] if oldest else None, waiting),
    )
    return database, processes


async def status(settings: Settings, *, answer_within: float = STATUS_TIMEOUT) -> Status:
    """Read the database and the broker at the same time, each within ``answer_within`` seconds."""

    async def read_database() -> tuple[DatabaseStatus, list[ProcessView]]:
        return await _with_engine(
            settings,
            lambda engine: database_status(engine, sample_interval=settings.sample_interval),
        )

    async def read_broker() -> list[QueueStatus]:
        connection = await connect(
            settings.amqp_url,
            name=APPLICATION_NAME,
            within=answer_within,
            liveness=Liveness.of(settings),
        )
        async with connection:
            return await queue_status(connection, settings)

    errors: dict[str, str] = {}
    process, read, queues = await asyncio.gather(
        local_process(settings, within=answer_within),
        _part(read_database(), answer_within, errors, "database", Service.POSTGRESQL, settings),
        _part(read_broker(), answer_within, errors, "broker", Service.RABBITMQ, settings),
    )
    database, processes = read if read is not None else (None, None)
    return Status(
        queues=queues, database=database, errors=errors, process=process, processes=processes
    )


async def _part(
    read: Awaitable[_T],
    answer_within: float,
    errors: dict[str, str],
    part: str,
    service: Service,
    settings: Settings,
) -> _T | None:
    """``read``'s result, or None with why ``service`` could not be read in ``errors[part]``:
    what to fix (``_unread``). Any other ``ConfigurationError`` (a
    setting no read can fix) is raised."""
    url = settings.database_url if service is Service.POSTGRESQL else settings.amqp_url
    try:
        async with asyncio.timeout(answer_within):
            return await read
    except TimeoutError:
        cause = f"no answer within {format_duration(answer_within)}"
        errors[part] = cannot_reach(service, url, cause)
    except AccessRefused as exc:
        errors[part] = str(exc)
    except ConfigurationError:
        raise  # (a setting no read can fix: the command's usage error)
    except Exception as exc:
        errors[part] = _unread(exc, service, url)
    return None


def _unread(exc: Exception, service: Service, url: str) -> str:
    """Why ``service`` could not be read, as the one sentence that says what to fix: a
    refusal's (login, database, virtual host, TLS), a schema the migrations have not made, or
    ``cannot_reach``'s."""
    refused = refusal(exc)
    if refused is not None:
        return str(refused)
    if service is Service.POSTGRESQL and classify(exc) is Fault.DEPLOYMENT:
        return (
            f"PostgreSQL answered, but the worker's tables are missing or behind "
            f"({describe_error(innermost(exc))}): run `worker migrate` first"
        )
    return cannot_reach(service, url, describe_error(innermost(exc)))


async def outbox_list(
    settings: Settings, states: Sequence[str], *, routing_key: str | None = None, limit: int
) -> list[inspection.OutboxEntry]:
    """``read_outbox`` on a one-connection engine of ``settings``."""
    return await _with_engine(
        settings,
        lambda engine: read_outbox(engine, states, routing_key=routing_key, limit=limit),
    )


async def read_outbox(
    engine: AsyncEngine,
    states: Sequence[str],
    *,
    routing_key: str | None = None,
    limit: int,
    after: inspection.OutboxCursor | None = None,
    scan: int | None = None,
) -> list[inspection.OutboxEntry]:
    """Up to ``limit`` rows of each of ``states`` (of ``inspection.OUTBOX_STATES``), of
    ``routing_key`` if given (sought among the first ``scan`` rows of each state only, if
    given), in the order of ``states`` (each after ``after``, a keyset cursor, if given); read
    in one read-only snapshot, so a row moving between states while it is read is shown once.
    Nothing changes."""
    snapshot = engine.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
    async with snapshot.begin() as conn:
        return [
            entry
            for state in states
            for entry in await inspection.outbox_entries(
                conn, state, limit, routing_key=routing_key, after=after, scan=scan
            )
        ]


@dataclass(frozen=True)
class Retried:
    """What ``retry_outbox`` did: backing-off rows made due now (``hurried``), parked rows moved
    back into the outbox (``moved``), and of the requested ids those already due (``due``) and
    those that are no unpublished event at all (``unknown``)."""

    hurried: list[inspection.HurriedOutboxRow]
    moved: list[inspection.RetriedOutboxRow]
    due: list[int]
    unknown: list[int]

    @property
    def routing_keys(self) -> list[str]:
        """The routing key of each row retried, hurried or moved."""
        return [row.routing_key for row in self.hurried] + [row.routing_key for row in self.moved]


async def retry_outbox(
    settings: Settings,
    ids: Sequence[int] | None = None,
    *,
    routing_key: str | None = None,
    states: Sequence[str] = inspection.RETRY_STATES,
) -> Retried:
    """``retry_outbox_rows`` on a one-connection engine of ``settings``."""
    return await _with_engine(
        settings,
        lambda engine: retry_outbox_rows(
            engine, ids, routing_key=routing_key, states=states, notify=settings.outbox_notify
        ),
    )


async def retry_outbox_rows(
    engine: AsyncEngine,
    ids: Sequence[int] | None = None,
    *,
    routing_key: str | None = None,
    states: Sequence[str] = inspection.RETRY_STATES,
    notify: bool,
    dry_run: bool = False,
) -> Retried:
    """Publish unpublished events again, now: those with ``ids``, else those of ``routing_key``,
    else all, of ``states`` (backing-off, parked, or both), in one transaction.

    A backing-off row is made due by the database's clock and keeps its attempts
    (``inspection.hurry_outbox``); a parked row moves back into the outbox under its own
    ``message_id``, so a consumer that already got a copy deduplicates the next one, with 0
    attempts and a new outbox id (``inspection.retry_parked_outbox``: a row with an ordering key
    goes out after the rows of its key emitted before this commit). With ``notify``
    (``outbox_notify``), relays are woken at commit (they poll anyway). With ``dry_run`` the
    transaction is rolled back, so the answer is exactly what a real run would have done at
    that instant (its new outbox ids excepted: they are not kept).
    """
    async with engine.connect() as conn, conn.begin() as transaction:
        hurried = (
            await inspection.hurry_outbox(conn, ids, routing_key=routing_key, notify=notify)
            if "backing-off" in states
            else []
        )
        moved = (
            await inspection.retry_parked_outbox(conn, ids, routing_key=routing_key, notify=notify)
            if "parked" in states
            else []
        )
        found = {row.id for row in hurried} | {row.parked_id for row in moved}
        rest = sorted({i for i in ids or () if i not in found})
        due = await inspection.pending_outbox_ids(conn, rest) if rest else []
        if dry_run:
            await transaction.rollback()
    return Retried(hurried, moved, due, [i for i in rest if i not in due])


@dataclass(frozen=True)
class Cancelled:
    """What ``cancel_outbox`` did to each message id asked for, in the order asked: those taken
    back (``cancelled``: never published once the transaction committed), the timers of
    workflows' open waits (``timers``: left scheduled, as without one a wait would end only
    by its signal, and a sleep never), those parked in ``outbox_parked`` (left
    there: ``worker outbox retry`` or nothing), and the rest (``unknown``: published already,
    or never an event of this outbox; the outbox keeps no record of what it published, so the
    two cannot be told apart)."""

    cancelled: list[uuid.UUID]
    parked: list[uuid.UUID]
    unknown: list[uuid.UUID]
    timers: list[uuid.UUID] = dataclasses.field(default_factory=list)


async def cancel_outbox(
    settings: Settings, message_ids: Sequence[uuid.UUID], *, dry_run: bool = False
) -> Cancelled:
    """``cancel_outbox_events`` on a one-connection engine of ``settings``."""
    return await _with_engine(
        settings, lambda engine: cancel_outbox_events(engine, message_ids, dry_run=dry_run)
    )


async def cancel_outbox_events(
    engine: AsyncEngine, message_ids: Sequence[uuid.UUID], *, dry_run: bool = False
) -> Cancelled:
    """Cancel the unpublished events ``message_ids`` (scheduled, or waiting in the outbox) with
    ``worker.sql.outbox.cancel``, all in one transaction, except a workflow's timer (see
    ``Cancelled``); with ``dry_run`` that transaction is rolled back, so the answer is exactly
    what a real run would have done at that instant."""
    asked = list(dict.fromkeys(message_ids))
    async with engine.connect() as conn, conn.begin() as transaction:
        timers = set(await inspection.open_wait_timers(conn, asked))
        events = [message_id for message_id in asked if message_id not in timers]
        taken = [message_id for message_id in events if await outbox.cancel(conn, message_id)]
        rest = [message_id for message_id in events if message_id not in taken]
        parked = set(await inspection.parked_message_ids(conn, rest)) if rest else set()
        if dry_run:
            await transaction.rollback()
    return Cancelled(
        taken,
        [m for m in rest if m in parked],
        [m for m in rest if m not in parked],
        [m for m in asked if m in timers],
    )


async def _with_engine(settings: Settings, use: Callable[[AsyncEngine], Awaitable[_T]]) -> _T:
    """``use`` a one-connection engine, disposed of afterwards."""
    async with one_connection(settings, APPLICATION_NAME) as engine:
        return await use(engine)


def to_json(value: Any) -> str:
    """One line of JSON for a result of this module (dataclasses, datetimes as ISO 8601)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.dumps(value, default=_json_default)


def _json_default(value: object) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
