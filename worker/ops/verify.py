"""``worker verify``: check, once a deployment is quiet, that the guarantees held.

Invariant: when every message has been handled and every event relayed, the state is what
exactly-once effects and at-least-once events imply. No inbox key is stuck in progress (a unit
of work never commits one; a workflow's is resumed once its owner is dead or its lease expired);
the outbox is drained; nothing is parked unless that is allowed; with ``quiet_queue``, no message
waits in the work queue or a retry queue; and every invariant a handler module declares about its
own tables holds.

A handler module declares its invariants through the ``invariants`` hook (``plugins.hook``): a
module-level list of async callables, in the module itself or in its ``invariants`` submodule
(the payments example's ``examples/payments/invariants.py``); each takes the ``Deployment`` and
returns a ``Check``, or None when it does not apply. They are found for the modules named in
``handlers`` and the installed ``worker.handlers`` entry points, as ``plugins.load_routers``
finds routers. Checks only read, except those that say otherwise (the payments example drains
``capture_queue``).
"""

from __future__ import annotations

import inspect
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import database
from worker.core.handler import HandlerKind
from worker.core.router import Router
from worker.errors import ConfigurationError, Service, cannot_reach, innermost, refusal
from worker.liveness import Liveness
from worker.logs import describe_error
from worker.ops import admin, plugins
from worker.ops.dlq import list_parked
from worker.ops.workflows import resume_command
from worker.settings import Settings, format_duration
from worker.sql import inspection, owners
from worker.transport.connection import connect

APPLICATION_NAME = "worker-verify"
CONNECT_TIMEOUT = 10.0
"""Seconds PostgreSQL and RabbitMQ may take to answer before verify reports them unreachable."""

SAMPLE = 5
"""How many offending rows a failed check names."""


@dataclass(frozen=True)
class Check:
    """The outcome of one invariant: its name, whether it holds, and what was found."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Options:
    """What ``worker verify`` tolerates and what it is asked to compare.

    ``expected_balances`` and ``capture_queue`` are for handler modules' invariants (the payments
    example reads both); the worker's own checks ignore them.
    """

    stuck_after: float = 300.0
    max_outbox_age: float = 60.0
    allow_parked: bool = False
    quiet_queue: bool = False
    no_dead_letters: bool = False
    expected_balances: Mapping[str, int] | None = None
    capture_queue: str | None = None


@dataclass(frozen=True)
class Deployment:
    """What an invariant looks at: the settings, the handlers, the database and the broker."""

    settings: Settings
    router: Router
    engine: AsyncEngine
    connection: AbstractRobustConnection
    options: Options


Invariant = Callable[[Deployment], Awaitable[Check | None]]


async def verify(
    settings: Settings,
    router: Router,
    engine: AsyncEngine,
    connection: AbstractRobustConnection,
    options: Options,
    *,
    invariants: Sequence[Invariant] | None = None,
) -> list[Check]:
    """Check the worker's invariants, then ``invariants`` (default: those of the handler modules
    in ``settings.handlers`` and the installed ones), one after the other, in that order.

    An invariant that raises is a failed check named after its function, with the cause.
    """
    deployment = Deployment(settings, router, engine, connection, options)
    extra = (
        load_invariants(settings.handlers, include_installed=settings.installed_handlers)
        if invariants is None
        else invariants
    )
    checks: list[Check] = []
    for invariant in (*WORKER_INVARIANTS, *extra):
        try:
            check = await invariant(deployment)
        except Exception as exc:
            check = Check(name_of(invariant), False, f"could not check: {describe_error(exc)}")
        if check is not None:
            checks.append(check)
    return checks


SERVICE_CHECKS = frozenset({"database", "broker"})
"""The checks that fail when PostgreSQL or RabbitMQ cannot be read (``worker verify`` exits 3)."""


async def check_deployment(
    settings: Settings,
    router: Router,
    options: Options,
    invariants: Sequence[Invariant] | None = None,
    *,
    answer_within: float = CONNECT_TIMEOUT,
) -> list[Check]:
    """``verify`` on connections of its own, closed afterwards. When PostgreSQL or RabbitMQ does
    not answer within ``answer_within`` seconds, only a failed ``database`` or ``broker`` check is
    returned for each: nothing else can be told."""
    async with database.one_connection(settings, APPLICATION_NAME) as engine:
        unreachable: list[Check] = []
        try:
            await database.probe(engine, within=answer_within)
        except Exception as exc:
            failure = _unreachable(Service.POSTGRESQL, settings.database_url, exc, answer_within)
            unreachable.append(Check("database", False, failure))
        try:
            connection = await connect(
                settings.amqp_url,
                name=APPLICATION_NAME,
                within=answer_within,
                liveness=Liveness.of(settings),
            )
        except Exception as exc:
            failure = _unreachable(Service.RABBITMQ, settings.amqp_url, exc, answer_within)
            unreachable.append(Check("broker", False, failure))
            return unreachable
        async with connection:
            if unreachable:
                return unreachable
            return await verify(
                settings, router, engine, connection, options, invariants=invariants
            )


def _unreachable(service: Service, url: str, exc: Exception, answer_within: float) -> str:
    """Why ``service`` at ``url`` could not be read: a refusal's own sentence, else
    ``cannot_reach``'s."""
    if isinstance(exc, TimeoutError):
        return cannot_reach(service, url, f"no answer within {format_duration(answer_within)}")
    if (refused := refusal(exc)) is not None:
        return str(refused)
    return cannot_reach(service, url, describe_error(innermost(exc)))


def name_of(invariant: Invariant) -> str:
    """The name of an invariant's check: its function's name with dashes (``outbox-drained``)."""
    return getattr(invariant, "__name__", repr(invariant)).replace("_", "-")


# Finding handler modules' invariants


def load_invariants(targets: Iterable[str], *, include_installed: bool = True) -> list[Invariant]:
    """The invariants of every named handler module (``module`` or ``module:router``) and, with
    ``include_installed``, of every installed ``worker.handlers`` entry point, each once."""
    found: dict[int, Invariant] = {}
    for module_name in plugins.module_names(targets, include_installed=include_installed):
        for invariant in invariants_of(module_name):
            found.setdefault(id(invariant), invariant)
    return list(found.values())


def invariants_of(module_name: str) -> list[Invariant]:
    """The ``invariants`` hook of the module (``plugins.hook``); [] if it has none."""
    value = plugins.hook(module_name, "invariants")
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(
        inspect.iscoroutinefunction(item) for item in value
    ):
        raise ConfigurationError(
            f"{module_name}: `invariants` must be a list of async functions taking a Deployment"
        )
    return list(value)


def read_expected_balances(path: str | Path) -> dict[str, int]:
    """``{account: cents}`` from a JSON file, for ``Options.expected_balances``."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot read expected balances from {path}: {exc}") from exc
    if not isinstance(value, dict) or not all(
        isinstance(cents, int) and not isinstance(cents, bool) for cents in value.values()
    ):
        raise ConfigurationError(
            f"{path}: expected balances must be a JSON object of account: integer cents"
        )
    return {str(account): cents for account, cents in value.items()}


# The worker's own invariants


def sample(items: Sequence[str], total: int) -> str:
    """The first few of ``total`` items, comma-separated, saying how many more there are."""
    shown = list(items[:SAMPLE])
    more = total - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _unit_of_work_handlers(router: Router) -> list[str]:
    return [
        handler.name for handler in router.handlers() if handler.kind is not HandlerKind.WORKFLOW
    ]


async def no_stuck_inbox_keys(deployment: Deployment) -> Check:
    """No key in progress outside a workflow: a unit of work claims, applies and completes its key
    in one transaction, so a committed in-progress row of one can only be a bug."""
    handlers = _unit_of_work_handlers(deployment.router)
    async with deployment.engine.connect() as conn:
        total, keys = await inspection.stuck_unit_of_work_keys(conn, handlers, SAMPLE)
    if not total:
        return Check("no-stuck-inbox-keys", True, "no key in progress outside a workflow")
    names = [f"{key.handler}/{key.key}" for key in keys]
    return Check(
        "no-stuck-inbox-keys",
        False,
        f"{total} key(s) in progress outside a workflow: {sample(names, total)}",
    )


async def no_stuck_workflows(deployment: Deployment) -> Check:
    """No workflow whose lease expired more than ``stuck_after`` ago: its owner died and no
    delivery took it over. A workflow with a live lease, or one that expired recently, is fine;
    so is one waiting for a signal or a deadline (it released its lease on purpose) until its
    deadline is more than ``stuck_after`` past (its timer should have resumed it)."""
    handlers = _unit_of_work_handlers(deployment.router)
    stuck_after = deployment.options.stuck_after
    async with deployment.engine.connect() as conn:
        in_progress = await inspection.in_progress_count(conn)
        total, keys = await inspection.expired_workflows(
            conn, handlers, expired_for=stuck_after, limit=SAMPLE
        )
    limit = format_duration(stuck_after)
    if not total:
        return Check(
            "no-stuck-workflows",
            True,
            f"{in_progress} key(s) in progress, no workflow lease expired more than {limit} ago",
        )
    names = [
        f"{key.handler}/{key.key} (recovery point {key.recovery_point or '-'}, "
        + (
            f"waiting until {key.wait_due_at.isoformat()}, not resumed: is a relay running, "
            "or was its timer cancelled?)"
            if key.wait_due_at is not None
            else f"lease until {key.lease_until.isoformat() if key.lease_until else '-'})"
        )
        for key in keys
    ]
    return Check(
        "no-stuck-workflows",
        False,
        f"{total} workflow(s) whose lease expired more than {limit} ago: {sample(names, total)}",
    )


async def no_orphaned_workflows(deployment: Deployment) -> Check:
    """No workflow held by a dead owner past its lease: its owner died without letting go (its
    process's owner lock is gone, or cannot be told) and nothing took it over, though any of its
    messages would have at once, so none is coming. Flagged at once, not after ``stuck_after``,
    each with the command that resumes it."""
    async with deployment.engine.begin() as conn:
        total, orphans = await owners.orphaned_workflows(conn, SAMPLE)
    if not total:
        return Check("no-orphaned-workflows", True, "no workflow held by a dead owner")
    names = [
        f"{o.handler}/{o.key} (recovery point {o.recovery_point or '-'}, owner {o.owner} "
        f"{'gone' if o.gone else 'not known alive'}, lease until {o.lease_until.isoformat()}; "
        f"resume it: {resume_command(o.handler, o.key)})"
        for o in orphans
    ]
    return Check(
        "no-orphaned-workflows",
        False,
        f"{total} workflow(s) held by a dead owner, nothing resuming them: {sample(names, total)}",
    )


async def outbox_drained(deployment: Deployment) -> Check:
    """No outbox row older than ``max_outbox_age``: every committed event was published, or is
    younger than that (being relayed, or retried after a recent failure)."""
    max_age = deployment.options.max_outbox_age
    async with deployment.engine.connect() as conn:
        stats = await inspection.outbox_stats(conn)
        total, late = await inspection.outbox_older_than(conn, max_age, SAMPLE)
    limit = format_duration(max_age)
    if not total:
        return Check(
            "outbox-drained", True, f"{stats.backlog} row(s) waiting, none older than {limit}"
        )
    names = [
        f"id={row.id} {row.routing_key} age={row.age_seconds:.1f}s attempts={row.attempts}"
        + (f" last_error={row.last_error!r}" if row.last_error else "")
        for row in late
    ]
    return Check(
        "outbox-drained",
        False,
        f"{total} of {stats.backlog} row(s) waiting longer than {limit}: {sample(names, total)}",
    )


async def outbox_nothing_parked(deployment: Deployment) -> Check:
    """No row in ``outbox_parked`` (the relay gave up on it), unless ``allow_parked``."""
    async with deployment.engine.connect() as conn:
        parked = await inspection.outbox_entries(conn, "parked", SAMPLE)
        total = (await inspection.outbox_stats(conn)).parked
    if not total:
        return Check("outbox-nothing-parked", True, "no parked outbox row")
    names = [f"id={row.id} {row.routing_key} last_error={row.last_error!r}" for row in parked]
    allowed = " (allowed)" if deployment.options.allow_parked else ""
    return Check(
        "outbox-nothing-parked",
        deployment.options.allow_parked,
        f"{total} parked outbox row(s){allowed}: {sample(names, total)}",
    )


async def work_queue_empty(deployment: Deployment) -> Check | None:
    """With ``quiet_queue``: no ready message in the work queue or a delayed-retry queue.

    A passive declare counts ready messages only. Deliveries a consumer holds unacked are not
    visible through AMQP; the consumer count says whether there can be any (none without
    consumers, since a closed channel returns its unacked deliveries to the queue).
    """
    if not deployment.options.quiet_queue:
        return None
    queues = await admin.queue_status(deployment.connection, deployment.settings)
    problems: list[str] = []
    work = ""
    for queue in queues:
        if queue.role == "dead letters":
            continue
        if not queue.exists:
            problems.append(f"{queue.name} does not exist")
        elif queue.messages:
            problems.append(f"{queue.name} has {queue.messages} ready")
        if queue.role == "work" and queue.exists:
            work = f"{queue.name}: {queue.messages} ready, {queue.consumers} consumer(s)"
            if queue.consumers:
                work += " (their unacked deliveries cannot be counted)"
    retry = sum(1 for queue in queues if queue.role.startswith("retry"))
    if problems:
        return Check("work-queue-empty", False, "; ".join(problems))
    return Check("work-queue-empty", True, f"{work}; {retry} retry queue(s) empty")


async def dead_letters(deployment: Deployment) -> Check:
    """The messages in the dead-letter queue, by reason: informational, unless
    ``no_dead_letters``. They are read unacked and put back in order."""
    queues = await admin.queue_status(deployment.connection, deployment.settings)
    dlq = next(queue for queue in queues if queue.role == "dead letters")
    if not dlq.exists:
        return Check("dead-letters", True, f"{dlq.name} does not exist: nothing parked")
    parked = await list_parked(deployment.connection, deployment.engine, deployment.settings)
    if not parked:
        return Check("dead-letters", True, f"{dlq.name} is empty")
    reasons = Counter(message.reason for message in parked)
    by_reason = " ".join(f"{reason}={count}" for reason, count in sorted(reasons.items()))
    forbidden = deployment.options.no_dead_letters
    return Check(
        "dead-letters",
        not forbidden,
        f"{len(parked)} message(s) in {dlq.name}: {by_reason}"
        + (" (none allowed)" if forbidden else ""),
    )


WORKER_INVARIANTS: tuple[Invariant, ...] = (
    no_stuck_inbox_keys,
    no_stuck_workflows,
    no_orphaned_workflows,
    outbox_drained,
    outbox_nothing_parked,
    work_queue_empty,
    dead_letters,
)
"""The invariants of any deployment, checked first, in this order."""


def to_json(checks: Sequence[Check]) -> dict[str, Any]:
    """One object: ``ok`` when every check holds, and the checks."""
    return {
        "ok": all(check.ok for check in checks),
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
    }
