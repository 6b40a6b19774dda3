"""How the deployment is doing: ``worker status`` (one overview), ``verify`` (the guarantees held)
and ``health`` (the local worker's /healthz)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from worker.errors import ConfigurationError
from worker.ops.cli.command import Command
from worker.ops.cli.exits import Exit
from worker.ops.cli.output import show
from worker.ops.plugins import load_routers
from worker.settings import Group, Settings, duration, format_duration

if TYPE_CHECKING:
    from worker.ops.admin import Status
    from worker.ops.overview import ProcessView


def _status(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import admin
    from worker.ops.overview import seen_within

    status = asyncio.run(admin.status(settings))
    if args.json:
        print(admin.to_json(status))
    else:
        lines = _status_lines(status, seen_within(settings.sample_interval))
        width = max(len(label) for label, _ in lines)
        for label, value in lines:
            show(f"{label:<{width}}  {value}".rstrip())
    for error in status.errors.values():
        show(f"worker: error: {error}", file=sys.stderr)
    return Exit.UNREACHABLE if status.errors else Exit.OK


def _status_lines(status: Status, window: float) -> list[tuple[str, str]]:
    """What ``worker status`` shows, as (label, value) lines in their order; ``window``: the
    seconds within which a process's last sample lists it."""
    lines = [
        *_status_headline(status),
        *_status_process_lines(status),
        *_status_outbox_headline(status),
        *_status_processes(status.processes, window),
        ("", ""),
    ]
    if status.queues is None:
        lines.append(("broker", "unavailable"))
    for queue in status.queues or ():
        counts = f"messages={queue.messages} consumers={queue.consumers}"
        lines.append((f"queue {queue.name}", counts if queue.exists else "missing"))
    if status.database is None:
        lines.append(("database", "unavailable"))
        return lines
    outbox, inbox = status.database.outbox, status.database.inbox
    lines.append(("outbox waiting for a retry", str(outbox.waiting_for_retry)))
    scheduled = f"{'~' if outbox.scheduled_estimated else ''}{outbox.scheduled}"
    if outbox.scheduled_overdue_seconds > 0:
        scheduled += f" (earliest overdue by {outbox.scheduled_overdue_seconds:.1f}s)"
    lines.append(("outbox scheduled", scheduled))
    lines += [(f"inbox {name}", str(count)) for name, count in inbox.items()]
    workflows = str(status.database.workflows.in_progress)
    if status.database.workflows.waiting:
        workflows += f", {status.database.workflows.waiting} of them waiting"
    if (oldest := status.database.workflows.oldest) is not None:
        workflows += (
            f" (oldest: handler={oldest.handler} key={oldest.key} "
            f"recovery_point={oldest.recovery_point or '-'} "
            f"updated_at={oldest.updated_at.isoformat()})"
        )
    lines.append(("workflows in progress", workflows))
    return lines


def _status_headline(status: Status) -> list[tuple[str, str]]:
    """What a person needs first: is anyone consuming, how much waits, how much failed."""
    work = next((q for q in status.queues or () if q.role == "work"), None)
    parked = next((q for q in status.queues or () if q.role == "dead letters"), None)
    if work is None:
        return [("consuming", "unknown: the broker cannot be read")]
    if not work.exists:
        lines = [("consuming", f"no: queue {work.name} does not exist (no worker started)")]
    elif work.consumers:
        lines = [("consuming", f"yes: {work.consumers} consumer(s) on {work.name}")]
    else:
        lines = [("consuming", f"no: nobody consumes {work.name} (stopped, or paused)")]
    lines.append(("waiting", f"{work.messages or 0} message(s) ready in {work.name}"))
    if parked is not None:
        lines.append(("dead-lettered", f"{parked.messages or 0} in {parked.name}"))
    return lines


def _status_process_lines(status: Status) -> list[tuple[str, str]]:
    """What the worker on this host says at its /healthz: paused or throttled, why and
    since when (the queues cannot tell: a throttled consumer still consumes)."""
    process = status.process
    if process is None:
        return []
    if process.health is None:
        return [("worker on this host", f"{process.error} at {process.url}")]
    health = process.health
    lines = [("worker on this host", f"{health.get('status', '?')} at {process.url}")]
    if paused := health.get("paused"):
        since = health.get("paused_since", "?")
        lines.append(("paused", f"{paused} since {since}: {health.get('paused_because', '')}"))
    if health.get("throttled"):
        since = health.get("throttled_since", "?")
        lines.append(
            ("throttled", f"since {since}: one message at a time after dead letters in a row")
        )
    return lines


def _status_processes(processes: list[ProcessView] | None, window: float) -> list[tuple[str, str]]:
    """Every worker and relay process that wrote a sample within ``window`` seconds: its state
    and why, when it last reported, and its rate over the last minute (none when the database
    could not be read: the lines below say so)."""
    if processes is None:
        return []
    seen = f"in the last {format_duration(window)}"
    if not processes:
        return [("", ""), ("processes", f"none reported {seen} (see sample_interval)")]
    lines = [("", ""), ("processes", f"{len(processes)} reported {seen}")]
    for process in processes:
        lines.append((f"{process.role} {process.host}:{process.pid}", _process_line(process)))
    return lines


def _process_line(process: ProcessView) -> str:
    """``consuming; reported 2s ago; 120.5 processed/s; up 3m``: a relay's rate is what it
    published, a worker's what it processed; ``-`` until two samples are a minute apart."""
    state = process.state + (f" ({process.reason})" if process.reason else "")
    if process.role == "relay":
        rate, unit = process.rates.published, "published/s"
    else:
        rate, unit = process.rates.processed, "processed/s"
    shown = "-" if rate is None else f"{rate:.1f}"
    return (
        f"{state}; reported {process.reported_seconds_ago:.0f}s ago; {shown} {unit}; "
        f"up {_age(process.up_seconds)}"
    )


def _age(seconds: float) -> str:
    """``42s``, ``5m``, ``3h``, ``2d``: the largest whole unit."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _status_outbox_headline(status: Status) -> list[tuple[str, str]]:
    if status.database is None:
        return []
    outbox = status.database.outbox
    backlog = str(outbox.backlog)
    if outbox.oldest_age_seconds is not None:
        backlog += f" (oldest {outbox.oldest_age_seconds:.1f}s)"
    return [("outbox backlog", backlog), ("outbox parked", str(outbox.parked))]


def _status_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object")


STATUS = Command(
    "status",
    _status,
    "one overview: processes, queues, outbox, inbox keys and workflows in progress",
    "Message and consumer counts of the work queue, the DLQ and each retry queue (passive "
    "declares: nothing is created); the outbox backlog, its oldest row's age, rows waiting "
    "for a retry, rows parked and events scheduled for later (estimated above 100,000, "
    "shown ~N; with how long the earliest due one is overdue); inbox keys by status; "
    "workflows in progress, how many of them wait (for a signal or a deadline: on purpose), "
    "and the least recently advanced one that does not wait; every worker and relay process "
    "that wrote a sample within three sample intervals: its state and why, when it reported, its "
    "rate over the last minute. Exits 3, after showing what "
    "it could read and why the rest could not be read, when PostgreSQL or RabbitMQ cannot be "
    "read.",
    reads=(Group.RETRIES, Group.ENDPOINT),
    options=_status_options,
)


def _verify(settings: Settings, args: argparse.Namespace) -> int:
    import json

    from worker.ops import verify

    router = load_routers(settings.handlers, include_installed=settings.installed_handlers)
    invariants = verify.load_invariants(
        settings.handlers, include_installed=settings.installed_handlers
    )
    if (args.expect_balances or args.capture_queue) and not invariants:
        raise ConfigurationError(
            "--expect-balances and --capture-queue are read by handler modules' invariants, "
            "and no handler module declares any (e.g. --handlers examples.payments)"
        )
    options = verify.Options(
        stuck_after=args.stuck_after,
        max_outbox_age=args.max_outbox_age,
        allow_parked=args.allow_parked,
        quiet_queue=args.quiet_queue,
        no_dead_letters=args.no_dead_letters,
        expected_balances=(
            verify.read_expected_balances(args.expect_balances) if args.expect_balances else None
        ),
        capture_queue=args.capture_queue,
    )
    checks = asyncio.run(verify.check_deployment(settings, router, options, invariants))
    unreachable = {check.name for check in checks if not check.ok} & verify.SERVICE_CHECKS
    if args.json:
        print(json.dumps(verify.to_json(checks)))
    else:
        for check in checks:
            show(f"{'PASS' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    if unreachable:
        return Exit.UNREACHABLE
    return Exit.OK if all(check.ok for check in checks) else Exit.FAILED


def _verify_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stuck-after",
        type=duration,
        default=300.0,
        metavar="DURATION",
        help="a workflow whose lease expired longer ago than this is stuck (default 5m)",
    )
    parser.add_argument(
        "--max-outbox-age",
        type=duration,
        default=60.0,
        metavar="DURATION",
        help="an outbox row older than this is not drained (default 1m)",
    )
    parser.add_argument(
        "--allow-parked", action="store_true", help="parked outbox rows do not fail the check"
    )
    parser.add_argument(
        "--quiet-queue",
        action="store_true",
        help="fail when a message waits in the work queue or a retry queue",
    )
    parser.add_argument(
        "--no-dead-letters", action="store_true", help="fail when the DLQ holds any message"
    )
    parser.add_argument(
        "--expect-balances",
        metavar="FILE",
        help="JSON {account: cents}: fail unless the balances are these (examples.payments)",
    )
    parser.add_argument(
        "--capture-queue",
        metavar="QUEUE",
        help="a queue bound to payment.settled: DRAINED (acked) to check that every settled "
        "payment's event arrived at least once (examples.payments)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object")


VERIFY = Command(
    "verify",
    _verify,
    "check the guarantees held: inbox, outbox, queues, handler modules' invariants",
    "Run it once the system is quiet (after a test, or kills and a restart). One line per\n"
    "invariant, `PASS name: detail` or `FAIL name: detail`; exit 1 when one fails, 2 on a\n"
    "usage error.\n\n"
    "  no-stuck-inbox-keys    no key in progress outside a workflow\n"
    "  no-stuck-workflows     no workflow lease expired more than --stuck-after ago\n"
    "  no-orphaned-workflows  no workflow held past its lease by a dead owner (at once, each\n"
    "                         with its `worker workflows resume` command)\n"
    "  outbox-drained         no outbox row older than --max-outbox-age\n"
    "  outbox-nothing-parked  no row in outbox_parked (unless --allow-parked)\n"
    "  work-queue-empty       with --quiet-queue: no ready message in the work or retry\n"
    "                         queues (AMQP cannot count unacked deliveries; consumers shown)\n"
    "  dead-letters           the DLQ by reason (a failure with --no-dead-letters)\n\n"
    "Then the `invariants` of each handler module; examples.payments: balances-match-ledger,\n"
    "one-notice-per-settlement, expected-balances, settled-events-delivered.",
    reads=(Group.RETRIES,),
    options=_verify_options,
)


def _health(settings: Settings, args: argparse.Namespace) -> int:
    import urllib.error
    import urllib.request

    from worker.ops.http import local_url

    if settings.http_port == 0:
        raise ConfigurationError("http_port is 0: this process serves no /healthz")
    url = local_url(settings.http_host, settings.http_port, "/healthz")
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            show(response.read().decode(errors="replace").strip())
            return 0
    except urllib.error.HTTPError as error:
        show(error.read().decode(errors="replace").strip())
    except OSError as exc:
        show(f"worker: error: no answer from {url}: {exc}", file=sys.stderr)
    return 1


HEALTH = Command(
    "health",
    _health,
    "ask the local worker's /healthz (for container health checks)",
    "GET http://<http_host>:<http_port>/healthz of the worker or relay on this host (a "
    "wildcard http_host asks the loopback address); exit 0 when it is healthy, 1 when not "
    "or unreachable.",
    reads=(Group.ENDPOINT,),
)
