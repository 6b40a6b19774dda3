"""The ``worker`` command: run the consumer or a relay, serve the HTTP ingress, apply migrations,
expire inbox keys, inspect and replay the dead-letter queue, send demo traffic.

Every setting is a ``WORKER_*`` environment variable, read by every command. A command takes as
flags only the settings of the groups it reads (``READS``), each shown once in its ``--help``, and
refuses another command's setting flag naming the commands that read it; a flag wins over its
variable. Every command takes the deployment's and the logging's flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import logging
import os
import shlex
import signal
import sys
from collections import Counter
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from aio_pika.abc import AbstractRobustConnection
from aio_pika.exceptions import ChannelNotFoundEntity

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from worker.ops.admin import Status
    from worker.ops.dlq import Outcome, Parked, Selection, Shown

from worker import logs
from worker.core.router import Router
from worker.errors import (
    ConfigurationError,
    Service,
    cannot_reach,
    innermost,
    unreachable_service,
)
from worker.ops import supervisor
from worker.ops.plugins import ENTRY_POINT_GROUP, load_routers
from worker.settings import FIELDS, Field, Group, Settings, duration, format_duration, positive_int
from worker.sql.inspection import OUTBOX_STATES, RETRY_STATES

log = logging.getLogger("worker")
_T = TypeVar("_T")


EVERY_COMMAND = (Group.DEPLOYMENT, Group.LOGGING)
"""The groups every command takes as flags: where the deployment is, and how to log."""

READS: Mapping[str, tuple[Group, ...]] = {
    "run": (
        *EVERY_COMMAND,
        Group.CONSUMER,
        Group.LIMITS,
        Group.COMPONENTS,
        Group.SUPERVISOR,
        Group.PROCESS,
        Group.ENDPOINT,
        Group.RELAY,
        Group.NOTIFY,
        Group.RETRIES,
        Group.SWEEP,
    ),
    "relay": (*EVERY_COMMAND, Group.PROCESS, Group.ENDPOINT, Group.RELAY, Group.NOTIFY),
    "serve": (*EVERY_COMMAND, Group.INGRESS, Group.LIMITS),
    "gc": (*EVERY_COMMAND, Group.RETRIES, Group.SWEEP),
    "workflows": EVERY_COMMAND,
    "dlq list": EVERY_COMMAND,
    "dlq show": EVERY_COMMAND,
    "dlq replay": (*EVERY_COMMAND, Group.RETRIES),
    "dlq purge": EVERY_COMMAND,
    "status": (*EVERY_COMMAND, Group.RETRIES, Group.ENDPOINT),
    "outbox list": EVERY_COMMAND,
    "outbox retry": (*EVERY_COMMAND, Group.NOTIFY),
    "verify": (*EVERY_COMMAND, Group.RETRIES),
    "health": (*EVERY_COMMAND, Group.ENDPOINT),
    "migrate": (*EVERY_COMMAND, Group.RETRIES),
    "declare": (*EVERY_COMMAND, Group.RETRIES),
    "convert-queues": (*EVERY_COMMAND, Group.RETRIES),
    "asyncapi": EVERY_COMMAND,
    "demo": (*EVERY_COMMAND, Group.RETRIES),
}
"""Each command and the groups of settings it reads, hence takes as flags.

RETRIES goes with inbox_retention (gc, dlq replay) as well as with the retry queues' names
(status, verify, demo's topology): Settings refuses a retention shorter than the retry chain, so
a command that takes one of the two must take the other. LIMITS is read by both ways a message
comes in, the consumer and the ingress, so the ingress accepts no body the consumer would park.
"""

ALIASES: Mapping[str, Mapping[str, str]] = {
    "serve": {"ingress_host": "--host", "ingress_port": "--port"},
}
"""Shorter spellings of a setting's flag that one command takes too: ``worker serve --port 8000``
is ``--ingress-port 8000``."""

HTTP_EXTRA = frozenset({"fastapi", "starlette", "uvicorn", "h11", "anyio", "click"})
"""Top-level modules of the ``http`` extra's packages: ``worker serve`` without one of them says
which extra to install."""


def readers(group: Group) -> list[str]:
    """The commands that read ``group``'s settings, in ``READS`` order."""
    return [command for command, groups in READS.items() if group in groups]


def _flag_help(spec: Field) -> str:
    help = f"{spec.help} [{spec.env}; default {spec.shown_default}]"
    return help.replace("%", "%%")


def _add_flag(section: argparse._ArgumentGroup, spec: Field, aliases: Sequence[str] = ()) -> None:
    """``spec``'s flag (``--x`` / ``--no-x`` for a switch) and its ``aliases``; None unless
    given."""
    if spec.switch:
        section.add_argument(
            spec.flag,
            dest=spec.name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=_flag_help(spec),
        )
    else:
        section.add_argument(
            spec.flag,
            *aliases,
            dest=spec.name,
            type=_parser_of(spec),
            default=None,
            metavar=spec.name.upper(),
            help=_flag_help(spec),
        )


def _parser_of(spec: Field) -> Callable[[str], Any]:
    """``spec.parse`` for argparse: its error names the flag's value redacted, or none for a
    secret (argparse's own message would repeat the value as given)."""

    def parse(raw: str) -> Any:
        try:
            return spec.parse(raw)
        except ValueError as exc:
            shown = f"{spec.shown(raw).removeprefix('=')}: " if not spec.secret else ""
            raise argparse.ArgumentTypeError(f"{shown}{exc}") from None

    parse.__name__ = spec.parse.__name__
    return parse


class _Refused(argparse.Action):
    """The flag of a setting the command does not read: a usage error that says who reads it,
    rather than argparse's "unrecognized arguments" (or a prefix match with another flag)."""

    def __init__(self, option_strings: list[str], dest: str, refusal: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, **kwargs)
        self.refusal = refusal

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.print_usage(sys.stderr)
        parser.exit(2, f"worker: error: {option_string} {self.refusal}\n")


def _add_settings(parser: argparse.ArgumentParser, command: str) -> None:
    """The flags of the settings ``command`` reads, a section per group; the others refused."""
    reads = READS[command]
    aliases = ALIASES.get(command, {})
    for group in (group for group in Group if group in reads):
        section = parser.add_argument_group(group.value)
        for spec in (spec for spec in FIELDS if spec.group is group):
            _add_flag(section, spec, [aliases[spec.name]] if spec.name in aliases else [])
    for spec in (spec for spec in FIELDS if spec.group not in reads):
        parser.add_argument(
            *spec.flags,
            dest=spec.name,
            action=_Refused,
            refusal=f"is not a setting of {command!r} "
            f"(it is read by: {', '.join(readers(spec.group))})",
            help=argparse.SUPPRESS,
        )


def settings_table() -> str:
    """The settings table of the documentation's configuration page (inserted by ``docs/hooks.py``
    when the site is built): a row per setting, in declaration order, with the commands that take
    its flag."""
    rows = [
        "| variable | flag | default | flag of | meaning |",
        "|---|---|---|---|---|",
        *(_table_row(spec) for spec in FIELDS),
    ]
    return "\n".join(rows) + "\n"


def _table_row(spec: Field) -> str:
    takers = readers(spec.group)
    aliases = [f"`{by[spec.name]}` (`{c}`)" for c, by in ALIASES.items() if spec.name in by]
    cells = (
        f"`{spec.env}`",
        " / ".join([*(f"`{flag}`" for flag in spec.flags), *aliases]),
        f"`{spec.shown_default}`",
        "every command" if takers == list(READS) else ", ".join(f"`{c}`" for c in takers),
        spec.help,
    )
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


_SETTING_NAMES = frozenset(spec.name for spec in FIELDS)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Usage names a command's own options, then ``[--SETTING ...]``: its settings are listed
    once, in their sections below."""

    def _format_usage(
        self,
        usage: str | None,
        actions: Iterable[argparse.Action],
        groups: Iterable[argparse._MutuallyExclusiveGroup],
        prefix: str | None,
    ) -> str:
        actions = list(actions)
        own = [action for action in actions if action.dest not in _SETTING_NAMES]
        text = super()._format_usage(usage, own, groups, prefix)
        if usage is not None or len(own) == len(actions):
            return text
        return text.rstrip("\n") + " [--SETTING ...]\n\n"


Action = Callable[[Settings, argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="worker",
        description=(
            "An asyncio RabbitMQ worker: each message's effect is committed exactly once in "
            "PostgreSQL together with the events it emits (transactional outbox); the message "
            "is acked only after that commit."
        ),
        epilog=(
            "Each command's --help lists the settings it reads, as flags. Every setting is also "
            "a WORKER_* environment variable, which every command reads; a flag wins over it."
        ),
        formatter_class=_HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        group: Any, name: str, func: Action, summary: str, description: str
    ) -> argparse.ArgumentParser:
        """The subcommand ``name`` (``dlq list``: ``list`` of ``dlq``), which takes the settings
        it reads as flags and runs ``func``."""
        sub: argparse.ArgumentParser = group.add_parser(
            name.split()[-1],
            help=summary,
            description=description,
            formatter_class=_HelpFormatter,
        )
        _add_settings(sub, name)
        sub.set_defaults(func=func)
        return sub

    command(
        commands,
        "run",
        _run,
        "consume the work queue with the given handler modules",
        "Declare the topology and consume until SIGTERM/SIGINT. Handler modules come from "
        f"the handlers setting and the {ENTRY_POINT_GROUP!r} entry-point group. With the "
        "processes setting above 1, this process supervises that many such worker processes: it "
        "forwards SIGTERM/SIGINT to them (another signal while they stop kills them), and "
        f"{supervisor.RestartPolicy().describe()}.",
    )
    command(
        commands,
        "relay",
        _relay,
        "publish committed outbox rows (a relay on its own, no consumer)",
        "Publish the outbox with publisher confirms until SIGTERM/SIGINT. Any number of "
        "relays may run at once, beside the ones inside `worker run`.",
    )
    command(
        commands,
        "serve",
        _serve,
        "serve the HTTP ingress: POST a message, GET its handler's result",
        "Serve POST /messages/<routing key> (a JSON body and an Idempotency-Key header: the "
        "request and its event are recorded in one transaction, 202 Accepted) and GET "
        "/messages/<routing key>/<key> (pending, completed with the handler's result, or "
        "failed) for every routing key of the handler modules, OpenAPI at /docs and /healthz, "
        "until SIGTERM/SIGINT; requests in flight then finish. Needs the http extra: "
        "pip install 'rabbit-outbox-worker[http]'.",
    )
    command(
        commands,
        "gc",
        _gc,
        "delete inbox keys older than the retention window, once",
        "One janitor sweep: delete completed and failed inbox keys older than "
        "inbox_retention in batches, then the ingress's requests accepted longer ago, unless "
        "another janitor is sweeping right now.",
    )

    workflows = command(
        commands,
        "workflows",
        _workflows,
        "list workflows in progress: their recovery point, owner and lease",
        "Workflows whose key is in progress, least recently advanced first: the last committed "
        "step, the delivery that owns it and until when (an expired lease is taken over by the "
        "next delivery).",
    )
    workflows.add_argument("--limit", type=positive_int, default=100, help="default 100")
    workflows.add_argument("--json", action="store_true", help="one JSON object per line")

    dlq = commands.add_parser(
        "dlq",
        help="inspect, replay or purge the dead-letter queue",
        description="Messages parked in <queue>.dlq, and why; replay sends them back to run, "
        "purge deletes them. Each takes the queue one message at a time (memory bounded by one "
        "message); the messages it leaves keep their place and order.",
    )
    dlq_commands = dlq.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    dlq_list = command(
        dlq_commands,
        "dlq list",
        _dlq_list,
        "show what is parked and why (the messages stay parked)",
        "Show the parked messages, oldest first, one line each as it is read; the queue is "
        "left as it was.",
    )
    shown = dlq_list.add_mutually_exclusive_group()
    shown.add_argument(
        "--limit", type=positive_int, default=DLQ_LIST_LIMIT, help=f"default {DLQ_LIST_LIMIT}"
    )
    shown.add_argument("--all", action="store_true", help="show every parked message")
    _dlq_filters(dlq_list)
    dlq_list.add_argument(
        "--json", action="store_true", help="one JSON object per message, no summary line"
    )
    dlq_show = command(
        dlq_commands,
        "dlq show",
        _dlq_show,
        "show one parked message in full: provenance, properties, headers, body",
        "Show the parked message with this id (`dlq list` shows each message's id: the "
        "worker's parking id, or sha256:... for a copy without the worker's record), its "
        "headers and its body, escaped for the terminal; the queue is left as it was.",
    )
    dlq_show.add_argument("id", help="the message's id, as `worker dlq list` shows it")
    dlq_show.add_argument(
        "--full",
        action="store_true",
        help=f"the whole body (default: its first {DLQ_SHOW_BODY_BYTES} bytes)",
    )
    dlq_replay = command(
        dlq_commands,
        "dlq replay",
        _dlq_replay,
        "clear the failed state and send parked messages back to the work queue",
        "For each parked message that the filters select (oldest first): forget that its key "
        "failed, send it back to the work queue, remove it from the DLQ. Each replayed message "
        "runs once. Refused and left parked unless --force: a message parked longer ago than "
        "inbox_retention (its key may have expired from the inbox, so it could run twice), and "
        "an unverified one (no record that the worker parked it: its headers could be anyone's; "
        "forced, it goes back as a fresh delivery that clears no inbox row). Prints a summary "
        "by reason and handler (--verbose: a line per message too).",
    )
    dlq_replay.add_argument("--limit", type=positive_int, help="replay at most this many")
    _dlq_filters(dlq_replay)
    dlq_replay.add_argument(
        "--force",
        action="store_true",
        help="replay messages parked before inbox_retention too, and unverified ones as fresh "
        "deliveries",
    )
    dlq_replay.add_argument(
        "--dry-run", action="store_true", help="show what would be replayed; change nothing"
    )
    _verbose(dlq_replay)
    dlq_purge = command(
        dlq_commands,
        "dlq purge",
        _dlq_purge,
        "delete the parked messages the filters select",
        "Delete each parked message that the filters select (all of them with --all); the "
        "others keep their place. Asks nothing: give at least one filter or --all. An "
        "unverified message (no record that the worker parked it) is deleted only with "
        "--reason unverified or --all. Messages parked after the purge began are left. Prints "
        "a summary by reason and handler (--verbose: a line per message too).",
    )
    dlq_purge.add_argument("--limit", type=positive_int, help="delete at most this many")
    _dlq_filters(dlq_purge)
    dlq_purge.add_argument("--all", action="store_true", help="delete every parked message")
    dlq_purge.add_argument(
        "--dry-run", action="store_true", help="show what would be deleted; change nothing"
    )
    _verbose(dlq_purge)

    status = command(
        commands,
        "status",
        _status,
        "one overview: queues, outbox, inbox keys and workflows in progress",
        "Message and consumer counts of the work queue, the DLQ and each retry queue (passive "
        "declares: nothing is created); the outbox backlog, its oldest row's age, rows waiting "
        "for a retry and rows parked; inbox keys by status; workflows in progress and the least "
        "recently advanced one. Exits 1, after showing what it could read, when PostgreSQL or "
        "RabbitMQ cannot be read.",
    )
    status.add_argument("--json", action="store_true", help="one JSON object")

    outbox = commands.add_parser(
        "outbox",
        help="list unpublished events (pending, backing off, parked) or publish them now",
        description="Events committed to the outbox and not yet confirmed by the broker: pending "
        "(due, a relay takes them next), backing-off (a publish failed; retried at their next "
        "attempt) and parked (in outbox_parked after the last attempt failed).",
    )
    outbox_commands = outbox.add_subparsers(dest="outbox_command", required=True, metavar="ACTION")
    outbox_list = command(
        outbox_commands,
        "outbox list",
        _outbox_list,
        "show unpublished events in every state, or in --state (nothing changes)",
        "Show unpublished events without their bodies: pending and backing-off rows in the "
        "order the relay takes them (their next attempt, its time by the database's clock, "
        "their attempts and last error), parked rows oldest first. At most --limit rows of each "
        "state, read from an index, however large the outbox.",
    )
    outbox_list.add_argument(
        "--state",
        dest="states",
        action="append",
        choices=OUTBOX_STATES,
        help="only rows in this state (repeatable; default: every state)",
    )
    outbox_list.add_argument("--routing-key", help="only rows of this routing key (exact)")
    outbox_list.add_argument(
        "--limit", type=positive_int, default=100, help="at most this many rows of each state"
    )
    outbox_list.add_argument("--json", action="store_true", help="one JSON object per line")
    outbox_retry = command(
        outbox_commands,
        "outbox retry",
        _outbox_retry,
        "publish backing-off and parked outbox rows now",
        "In one transaction: backing-off rows become due now by the database's clock (they keep "
        "their attempts), and parked rows move back into the outbox with their message_id, 0 "
        "attempts and their last error (each gets a new outbox id: a row with an ordering key "
        "goes out after the rows of its key emitted before the retry); relays are woken at "
        "commit. Which rows: --id, --routing-key or --all, of --state (default both). Prints "
        "how many by routing key (a line per row too with --id or --verbose). Exits 1 when an "
        "--id or the --routing-key matches no backing-off or parked row.",
    )
    _verbose(outbox_retry)
    which = outbox_retry.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--id",
        dest="ids",
        type=int,
        nargs="+",
        action="extend",
        metavar="ID",
        help="the rows' ids (as `worker outbox list` shows them)",
    )
    which.add_argument("--routing-key", help="every backing-off or parked row of this routing key")
    which.add_argument("--all", action="store_true", help="every backing-off and parked row")
    outbox_retry.add_argument(
        "--state",
        dest="states",
        action="append",
        choices=RETRY_STATES,
        help="only rows in this state (repeatable; default: both)",
    )

    verify = command(
        commands,
        "verify",
        _verify,
        "check the guarantees held: inbox, outbox, queues, handler modules' invariants",
        "Run it once the system is quiet (after a test, or kills and a restart). One line per\n"
        "invariant, `PASS name: detail` or `FAIL name: detail`; exit 1 when one fails, 2 on a\n"
        "usage error.\n\n"
        "  no-stuck-inbox-keys    no key in progress outside a workflow\n"
        "  no-stuck-workflows     no workflow lease expired more than --stuck-after ago\n"
        "  outbox-drained         no outbox row older than --max-outbox-age\n"
        "  outbox-nothing-parked  no row in outbox_parked (unless --allow-parked)\n"
        "  work-queue-empty       with --quiet-queue: no ready message in the work or retry\n"
        "                         queues (AMQP cannot count unacked deliveries; consumers shown)\n"
        "  dead-letters           the DLQ by reason (a failure with --no-dead-letters)\n\n"
        "Then the `invariants` of each handler module; examples.payments: balances-match-ledger,\n"
        "one-notice-per-settlement, expected-balances, settled-events-delivered.",
    )
    verify.add_argument(
        "--stuck-after",
        type=duration,
        default=300.0,
        metavar="DURATION",
        help="a workflow whose lease expired longer ago than this is stuck (default 5m)",
    )
    verify.add_argument(
        "--max-outbox-age",
        type=duration,
        default=60.0,
        metavar="DURATION",
        help="an outbox row older than this is not drained (default 1m)",
    )
    verify.add_argument(
        "--allow-parked", action="store_true", help="parked outbox rows do not fail the check"
    )
    verify.add_argument(
        "--quiet-queue",
        action="store_true",
        help="fail when a message waits in the work queue or a retry queue",
    )
    verify.add_argument(
        "--no-dead-letters", action="store_true", help="fail when the DLQ holds any message"
    )
    verify.add_argument(
        "--expect-balances",
        metavar="FILE",
        help="JSON {account: cents}: fail unless the balances are these (examples.payments)",
    )
    verify.add_argument(
        "--capture-queue",
        metavar="QUEUE",
        help="a queue bound to payment.settled: DRAINED (acked) to check that every settled "
        "payment's event arrived at least once (examples.payments)",
    )
    verify.add_argument("--json", action="store_true", help="one JSON object")

    command(
        commands,
        "health",
        _health,
        "ask the local worker's /healthz (for container health checks)",
        "GET http://<http_host>:<http_port>/healthz of the worker or relay on this host (a "
        "wildcard http_host asks the loopback address); exit 0 when it is healthy, 1 when not "
        "or unreachable.",
    )

    migrate = command(
        commands,
        "migrate",
        _migrate,
        "apply the worker's and the handler modules' migrations",
        "Upgrade the worker's tables, then each handler module's, to their heads; then "
        "declare the broker topology (as `worker declare`), so that messages published before "
        "the first `worker run` wait in the work queue instead of being dropped.",
    )
    migrate.add_argument(
        "--downgrade", action="store_true", help="undo every migration instead (drops the tables)"
    )
    migrate.add_argument(
        "--no-declare",
        dest="declare",
        action="store_false",
        help="leave the broker alone (migrate the database only)",
    )
    asyncapi = command(
        commands,
        "asyncapi",
        _asyncapi,
        "print the AsyncAPI document of the handler modules",
        "An AsyncAPI 3.0 document (JSON) generated from the handler modules: a channel per "
        "routing key on the exchange, each handler's body schema as its payload, and the events "
        "the handlers declare with publishes=. Nothing is connected to.",
    )
    asyncapi.add_argument("--title", help="the document's title (default: the handler modules)")
    asyncapi.add_argument("--output", "-o", help="write it to this file instead of stdout")
    command(
        commands,
        "declare",
        _declare,
        "declare the exchange, queues and bindings the handler modules need",
        "Declare (or confirm) the durable exchange, the work queue bound with every routing key "
        "of the handler modules, the dead-letter exchange and queue, and the delayed-retry "
        "queues, as `worker run` does at start; idempotent. Producers may then publish before "
        "any worker runs.",
    )
    command(
        commands,
        "convert-queues",
        _convert_queues,
        "declare the queues anew as queue_type says, moving their messages (workers stopped)",
        "For an existing deployment whose queues were declared otherwise (classic queues, say, "
        "with queue_type now quorum, or another delivery_limit): each queue the broker refuses "
        "to declare as the settings say is emptied into a holding queue `<queue>.moving` bound "
        "as it is, deleted, declared anew, and refilled, every message acked only after its "
        "copy was confirmed. Delayed retries wait their whole delay again. Stop the workers "
        "first (a queue with consumers is refused); producers may go on publishing. Safe to run "
        "again after an interruption; a no-op when the queues are as the settings say.",
    )

    demo = command(
        commands,
        "demo",
        _demo,
        "run the handler modules' demo hooks (the payments example's: payment requests)",
        "Run the `demo` hook of each handler module (default: examples.payments, whose hook "
        "publishes payment.requested messages, some of them duplicates, and prints the balances "
        "to expect).",
    )
    demo.add_argument("--count", type=int, default=100, help="messages to send (default 100)")
    demo.add_argument(
        "--duplicates", type=float, default=0.2, help="share of resent payments (default 0.2)"
    )
    demo.add_argument("--accounts", type=int, default=5, help="accounts to spread over")
    demo.add_argument(
        "--seed", type=int, default=1, help="random seed (payment ids derive from it)"
    )
    return parser


def _load_settings(args: argparse.Namespace) -> Settings:
    return Settings.load(**{spec.name: getattr(args, spec.name, None) for spec in FIELDS})


def _run(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import runner

    if settings.processes > 1:
        return supervisor.run_processes(settings, args.argv)
    router = _handler_modules(settings)

    async def serve(stop: asyncio.Event, started: asyncio.Event) -> None:
        supervisor.stop_when_orphaned(stop)
        await runner.run(settings, router, stop, started)

    asyncio.run(_until_signalled(serve))
    return 0


def _handler_modules(settings: Settings) -> Router:
    """The handler modules' router; a ``ConfigurationError`` when they hold no handler."""
    router = load_routers(settings.handlers, include_installed=settings.installed_handlers)
    if not router.handlers():
        raise ConfigurationError(
            "no handlers: name handler modules with --handlers or WORKER_HANDLERS, "
            f"or install a package with a {ENTRY_POINT_GROUP!r} entry point"
        )
    return router


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    try:
        from worker.ingress import serve
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in HTTP_EXTRA:
            raise
        raise ConfigurationError(
            f"worker serve needs the http extra ({exc.name} is not installed): "
            "pip install 'rabbit-outbox-worker[http]'"
        ) from exc
    router = _handler_modules(settings)
    asyncio.run(
        _until_signalled(
            lambda stop, started: serve.serve(
                settings, router, stop, started=lambda _port: started.set()
            )
        )
    )
    return 0


def _relay(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import runner

    asyncio.run(_until_signalled(lambda stop, started: runner.run_relay(settings, stop, started)))
    return 0


async def _until_signalled(
    serve: Callable[[asyncio.Event, asyncio.Event], Awaitable[object]],
) -> None:
    """Run ``serve(stop, started)`` until SIGTERM or SIGINT sets ``stop``.

    Before ``serve`` sets ``started`` (while it connects, retrying PostgreSQL or RabbitMQ for up
    to a minute), a signal cancels it instead, and ``Interrupted`` is raised once what it opened
    is closed: nothing was consuming or serving yet, so there is nothing to drain.
    """
    stop, started = asyncio.Event(), asyncio.Event()
    serving = asyncio.current_task()
    assert serving is not None
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        stop.set()
        if not started.is_set() and len(received) == 1:
            serving.cancel()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await serve(stop, started)
    except asyncio.CancelledError:
        if received and not started.is_set():
            raise Interrupted(received[0]) from None
        raise


def _gc(settings: Settings, args: argparse.Namespace) -> int:
    from worker.database import one_connection
    from worker.ops import janitor

    async def sweep() -> janitor.Sweep | None:
        async with one_connection(settings, "worker-gc") as engine:
            return await janitor.sweep(engine, settings)

    result = asyncio.run(sweep())
    if result is None:
        print("another janitor is sweeping the inbox; nothing done")
    else:
        print(
            f"deleted {result.deleted} inbox keys and {result.requests} ingress requests older "
            f"than {format_duration(settings.inbox_retention)} in {result.batches} batches"
        )
    return 0


def _workflows(settings: Settings, args: argparse.Namespace) -> int:
    from worker.database import one_connection
    from worker.ops import admin
    from worker.sql import inspection

    async def fetch() -> list[inspection.WorkflowState]:
        async with (
            one_connection(settings, admin.APPLICATION_NAME) as engine,
            engine.connect() as conn,
        ):
            return await inspection.in_progress_workflows(conn, args.limit)

    states = asyncio.run(fetch())
    for state in states:
        if args.json:
            print(admin.to_json(state))
        else:
            _show(
                f"handler={state.handler} key={state.key} "
                f"recovery_point={state.recovery_point or '-'} owner={state.owner or '-'} "
                f"lease_until={state.lease_until.isoformat() if state.lease_until else '-'} "
                f"attempts={state.attempts} updated_at={state.updated_at.isoformat()}"
            )
    if not args.json:
        print(f"{len(states)} workflow(s) in progress")
    return 0


DLQ_LIST_LIMIT = 100
"""Messages ``worker dlq list`` shows unless told otherwise."""

DLQ_SHOW_BODY_BYTES = 4096
"""Bytes of a body ``worker dlq show`` prints unless ``--full``."""


def _dlq_filters(parser: argparse.ArgumentParser) -> None:
    """The flags that select parked messages, shared by every ``dlq`` action."""
    parser.add_argument("--key", help="only the messages with this idempotency key")
    parser.add_argument(
        "--reason",
        help="only the messages parked for this reason (`unverified`: those without the "
        "worker's record of parking them)",
    )
    parser.add_argument("--handler", help="only the messages of this handler (its routing key)")


def _dlq_selection(args: argparse.Namespace) -> Selection:
    """The selection the filter flags make; an unknown reason is a usage error that lists the
    known ones."""
    import difflib

    from worker.ops.dlq import REASONS, Selection

    if args.reason is not None and args.reason not in REASONS:
        close = difflib.get_close_matches(args.reason, REASONS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigurationError(
            f"unknown reason {args.reason!r}{hint}; the reasons are: {', '.join(REASONS)}"
        )
    return Selection(key=args.key, reason=args.reason, handler=args.handler)


async def _with_dlq(
    settings: Settings, action: Callable[[AbstractRobustConnection, AsyncEngine], Awaitable[_T]]
) -> _T:
    """``action`` with a broker connection and a one-connection database engine (the DLQ's
    copies and the worker's records of them)."""
    from worker.database import one_connection

    async def with_engine(connection: AbstractRobustConnection) -> _T:
        async with one_connection(settings, "worker-dlq") as engine:
            return await action(connection, engine)

    return await _with_broker(settings, with_engine)


def _dlq_list(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import dlq

    limit = None if args.all else args.limit
    selection = _dlq_selection(args)

    async def show(connection: AbstractRobustConnection, engine: AsyncEngine) -> int:
        found = dlq.browse(connection, engine, settings, selection=selection, limit=limit)
        shown = 0
        async with contextlib.aclosing(found) as outcomes:
            async for outcome in outcomes:
                if args.json:
                    print(_parked_json(outcome.parked), flush=True)
                else:
                    print(_describe(outcome.parked), flush=True)
                shown += 1
        return shown

    shown = asyncio.run(_with_dlq(settings, show))
    if not args.json:
        more = f" (the first {limit}: --limit N or --all shows more)" if shown == limit else ""
        print(f"{shown} parked message(s) shown from {settings.dead_letter_queue}{more}")
    return 0


def _parked_json(parked: Parked) -> str:
    """One JSON object for ``parked`` (ASCII only: nothing in it can drive a terminal)."""
    import json

    return json.dumps(
        {
            "id": parked.id,
            "verified": parked.verified,
            "unverified_because": parked.unverified_because,
            "key": parked.key,
            "handler": parked.handler,
            "reason": parked.reason,
            "routing_key": parked.routing_key,
            "error": parked.error,
            "exception_type": parked.exception_type,
            "attempts": parked.attempts,
            "first_failure_at": parked.first_failure_at or None,
            "dead_lettered_at": (
                parked.dead_lettered_at.isoformat() if parked.dead_lettered_at else None
            ),
            "message_id": parked.message_id,
            "claims": dict(parked.claims),
        }
    )


def _dlq_show(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import dlq

    async def find(connection: AbstractRobustConnection, engine: AsyncEngine) -> list[Shown]:
        return await dlq.find(connection, engine, settings, args.id)

    found = asyncio.run(_with_dlq(settings, find))
    if not found:
        raise ConfigurationError(
            f"no message with id {args.id!r} in {settings.dead_letter_queue} "
            "(`worker dlq list` shows each message's id)"
        )
    for shown in found:
        _show_parked(shown, full=args.full)
    return 0


def _show_parked(shown: Shown, *, full: bool) -> None:
    """Print one parked message in full, every line escaped (``_show``): a body or a header can
    neither add lines nor drive the terminal."""
    from worker.ops.dlq import header_text

    parked = shown.parked
    _show(f"id: {parked.id}")
    if parked.verified:
        _show("provenance: parked by the worker (its record names this copy)")
    else:
        _show(f"provenance: unverified ({parked.unverified_because}): its headers are claims")
    _show(_describe(parked))
    _show("properties:")
    for name, value in shown.properties.items():
        if value is not None:
            _show(f"  {name}: {header_text(value)}")
    _show("headers:")
    for name, value in shown.headers.items():
        _show(f"  {name}: {header_text(value)}")
    body = shown.body if full else shown.body[:DLQ_SHOW_BODY_BYTES]
    cut = len(shown.body) - len(body)
    _show(
        f"body ({len(shown.body)} bytes"
        + (f"; the first {len(body)} shown, --full shows all" if cut else "")
        + "):"
    )
    for line in body.decode("utf-8", "replace").split("\n"):
        _show(line)


def _dlq_replay(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import dlq

    selection = _dlq_selection(args)

    async def replay(connection: AbstractRobustConnection, engine: AsyncEngine) -> tuple[int, int]:
        outcomes = dlq.replaying(
            connection,
            engine,
            settings,
            selection=selection,
            limit=args.limit,
            force=args.force,
            dry_run=args.dry_run,
        )
        return await _dlq_report(
            outcomes, "would replay" if args.dry_run else "replayed", verbose=args.verbose
        )

    done, refused = asyncio.run(_with_dlq(settings, replay))
    summary = f"{done} message(s) sent back to {settings.queue}"
    if args.dry_run:
        summary = f"dry run: {done} message(s) would be sent back to {settings.queue}"
    if refused:
        summary += f"; {refused} refused and left parked (--force replays them)"
    print(summary + ("; nothing changed" if args.dry_run else ""))
    return 0


def _dlq_purge(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import dlq

    selection = _dlq_selection(args)
    if not selection.filters and not args.all:
        raise ConfigurationError("dlq purge needs --key, --reason, --handler or --all")

    async def purge(connection: AbstractRobustConnection, engine: AsyncEngine) -> tuple[int, int]:
        outcomes = dlq.purging(
            connection,
            engine,
            settings,
            selection=selection,
            limit=args.limit,
            dry_run=args.dry_run,
        )
        return await _dlq_report(
            outcomes, "would purge" if args.dry_run else "purged", verbose=args.verbose
        )

    done, refused = asyncio.run(_with_dlq(settings, purge))
    if args.dry_run:
        summary = f"dry run: {done} message(s) would be purged from {settings.dead_letter_queue}"
    else:
        summary = f"{done} message(s) purged from {settings.dead_letter_queue}"
    if refused:
        summary += f"; {refused} unverified left parked (--reason unverified purges them)"
    print(summary)
    return 0


async def _dlq_report(
    outcomes: AsyncGenerator[Outcome, None], done: str, *, verbose: bool
) -> tuple[int, int]:
    """Carry out a bulk ``dlq`` action and print what it did, summed up by reason and handler
    (with ``verbose``, a line per message as it happens too); returns (done, refused)."""
    done_by: Counter[str] = Counter()
    refused_by: Counter[str] = Counter()
    async with contextlib.aclosing(outcomes) as each:
        async for outcome in each:
            parked = outcome.parked
            if outcome.done:
                done_by[f"{parked.reason} handler={parked.handler or '-'}"] += 1
                if verbose:
                    print(f"{done} {_describe(parked)}", flush=True)
            else:
                refused_by[str(outcome.refused)] += 1
                if verbose:
                    print(f"refused {_describe(parked)}: {outcome.refused}", flush=True)
    _summary(f"{done} by reason", done_by)
    _summary("refused", refused_by)
    return done_by.total(), refused_by.total()


def _summary(title: str, counts: Counter[str]) -> None:
    """One line per distinct value of ``counts``, most frequent first."""
    for value, count in counts.most_common():
        _show(f"{title}: {value}: {count}")


def _verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="a line per message or row, not only totals"
    )


async def _with_broker(
    settings: Settings,
    action: Callable[[AbstractRobustConnection], Awaitable[_T]],
    *,
    name: str = "worker-dlq",
) -> _T:
    """``action`` on a broker connection named ``name``, retried while the broker starts, closed
    afterwards."""
    from worker.ops.runner import connect_broker

    connection = await connect_broker(settings, name=name)
    try:
        return await action(connection)
    finally:
        await connection.close()


def _describe(message: Parked) -> str:
    """One line for a parked message: the worker's record's facts, or an unverified copy's
    claims marked as such."""
    if not message.verified:
        claims = " ".join(f"{name}={value!r}" for name, value in message.claims.items())
        return logs.printable(
            f"key={message.key or '-'} handler=- reason={message.reason} "
            f"routing_key={message.routing_key} id={message.id} "
            f"why={message.unverified_because!r} claims: {claims or 'none'}"
        )
    return logs.printable(
        f"key={message.key or '-'} handler={message.handler or '-'} reason={message.reason} "
        f"attempts={message.attempts} first_failure={message.first_failure_at or '-'} "
        f"routing_key={message.routing_key} id={message.id} error={message.error!r}"
    )


def _status_lines(status: Status) -> list[tuple[str, str]]:
    """What ``worker status`` shows, as (label, value) lines in their order."""
    lines = [
        *_status_headline(status),
        *_status_process_lines(status),
        *_status_outbox_headline(status),
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
    lines += [(f"inbox {name}", str(count)) for name, count in inbox.items()]
    workflows = str(status.database.workflows.in_progress)
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


def _status_outbox_headline(status: Status) -> list[tuple[str, str]]:
    if status.database is None:
        return []
    outbox = status.database.outbox
    backlog = str(outbox.backlog)
    if outbox.oldest_age_seconds is not None:
        backlog += f" (oldest {outbox.oldest_age_seconds:.1f}s)"
    return [("outbox backlog", backlog), ("outbox parked", str(outbox.parked))]


def _status(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import admin

    status = asyncio.run(admin.status(settings))
    if args.json:
        print(admin.to_json(status))
    else:
        lines = _status_lines(status)
        width = max(len(label) for label, _ in lines)
        for label, value in lines:
            _show(f"{label:<{width}}  {value}".rstrip())
    for error in status.errors.values():
        _show(f"worker: error: {error}", file=sys.stderr)
    return Exit.UNREACHABLE if status.errors else Exit.OK


def _outbox_list(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import admin

    states = _chosen(OUTBOX_STATES, args.states)
    entries = asyncio.run(
        admin.outbox_list(settings, states, routing_key=args.routing_key, limit=args.limit)
    )
    for entry in entries:
        if args.json:
            print(admin.to_json(entry))
        else:
            _show(_outbox_line(entry))
    if args.json:
        return 0
    shown = Counter(entry.state for entry in entries)
    counts = ", ".join(f"{shown[state]} {state}" for state in states)
    print(f"{counts} outbox row(s) shown")
    full = [state for state in states if shown[state] == args.limit]
    if full:
        print(f"(--limit {args.limit} reached for {', '.join(full)}: there may be more)")
    waiting = {entry.routing_key for entry in entries if entry.state != "pending"}
    if waiting:
        key = shlex.quote(waiting.pop()) if len(waiting) == 1 else "KEY"
        _show(
            f"`worker outbox retry --routing-key {key}` (or --id ID, --all) publishes "
            "backing-off and parked rows now"
        )
    return 0


def _outbox_line(entry: Any) -> str:
    """One row of ``worker outbox list``: its state, then ``name=value`` pairs."""
    fields = [
        f"{entry.state:<11} id={entry.id} message_id={entry.message_id}",
        f"exchange={entry.exchange or '(default)'} routing_key={entry.routing_key}",
        f"ordering_key={entry.ordering_key or '-'} attempts={entry.attempts}",
        f"created_at={entry.created_at.isoformat()}",
    ]
    if entry.parked_at is not None:
        fields.append(f"parked_at={entry.parked_at.isoformat()}")
    elif entry.attempts:
        fields.append(
            f"next_attempt={entry.available_at.isoformat()} (in {entry.due_in_seconds:.0f}s)"
        )
    if entry.last_error is not None:
        fields.append(f"last_error={entry.last_error!r}")
    return " ".join(fields)


def _chosen(states: Sequence[str], asked: Sequence[str] | None) -> list[str]:
    """The ``states`` asked for with ``--state`` (each once, in ``states``' order), or all."""
    return [state for state in states if asked is None or state in asked]


def _outbox_retry(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import admin

    states = _chosen(RETRY_STATES, args.states)
    retried = asyncio.run(
        admin.retry_outbox(
            settings,
            None if args.all or args.ids is None else args.ids,
            routing_key=args.routing_key,
            states=states,
        )
    )
    if args.verbose or args.ids:
        for hurried in retried.hurried:
            _show(f"hurried id={hurried.id} message_id={hurried.message_id}")
        for moved in retried.moved:
            _show(f"retried id={moved.parked_id} as id={moved.id} message_id={moved.message_id}")
    _summary("retried by routing key", Counter(retried.routing_keys))
    print(
        f"{len(retried.hurried)} backing-off outbox row(s) made due now, "
        f"{len(retried.moved)} parked outbox row(s) moved back into the outbox"
    )
    if retried.due:
        _show(f"already due (pending): {', '.join(map(str, retried.due))}", file=sys.stderr)
    if retried.unknown:
        _show(
            f"worker: error: no {' or '.join(states)} outbox row has id "
            f"{', '.join(map(str, retried.unknown))} (see `worker outbox list`)",
            file=sys.stderr,
        )
        return 1
    if args.routing_key is not None and not retried.routing_keys:
        _show(
            f"worker: error: no {' or '.join(states)} outbox row has routing key "
            f"{args.routing_key!r} (see `worker outbox list`)",
            file=sys.stderr,
        )
        return 1
    return 0


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
            _show(f"{'PASS' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    if unreachable:
        return Exit.UNREACHABLE
    return Exit.OK if all(check.ok for check in checks) else Exit.FAILED


def _health(settings: Settings, args: argparse.Namespace) -> int:
    import urllib.error
    import urllib.request

    from worker.ops.http import local_url

    if settings.http_port == 0:
        raise ConfigurationError("http_port is 0: this process serves no /healthz")
    url = local_url(settings.http_host, settings.http_port, "/healthz")
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            _show(response.read().decode(errors="replace").strip())
            return 0
    except urllib.error.HTTPError as error:
        _show(error.read().decode(errors="replace").strip())
    except OSError as exc:
        _show(f"worker: error: no answer from {url}: {exc}", file=sys.stderr)
    return 1


def _migrate(settings: Settings, args: argparse.Namespace) -> int:
    from worker import schema

    router = load_routers(settings.handlers, include_installed=settings.installed_handlers)
    if args.downgrade:
        schema.downgrade(settings, router)
        return 0
    schema.upgrade(settings, router)
    log.info("migrations applied")
    if args.declare:
        _declare(settings, args)
    return 0


def _asyncapi(settings: Settings, args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from worker.ops import asyncapi

    router = load_routers(settings.handlers, include_installed=settings.installed_handlers)
    if not router.handlers():
        raise ConfigurationError("no handlers: name handler modules with --handlers")
    text = json.dumps(asyncapi.document(router, settings, title=args.title), indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _declare(settings: Settings, args: argparse.Namespace) -> int:
    from worker.transport.topology import declare_topology

    routing_keys = load_routers(
        settings.handlers, include_installed=settings.installed_handlers
    ).routing_keys()

    async def declare(connection: AbstractRobustConnection) -> None:
        async with connection.channel() as channel:
            await declare_topology(channel, settings, routing_keys)

    asyncio.run(_with_broker(settings, declare, name="worker-declare"))
    log.info(
        "declared exchange %r, queue %r bound to %s, %r and %d retry queue(s)",
        settings.exchange,
        settings.queue,
        ", ".join(map(repr, routing_keys)) or "no routing key",
        settings.dead_letter_queue,
        len(settings.retry_delays),
    )
    return 0


def _convert_queues(settings: Settings, args: argparse.Namespace) -> int:
    from worker.transport.queue_move import convert

    routing_keys = load_routers(
        settings.handlers, include_installed=settings.installed_handlers
    ).routing_keys()

    async def run(connection: AbstractRobustConnection) -> int:
        moved = await convert(connection, settings, routing_keys)
        if not moved.converted:
            print(f"every queue is already declared as {settings.queue_type}: nothing to move")
        for name in moved.converted:
            print(f"declared {name} anew ({settings.queue_type})")
        for name, count in moved.messages.items():
            print(f"moved {count} message(s) of {name}")
        return 0

    return asyncio.run(_with_broker(settings, run, name="worker-convert-queues"))


def _demo(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import demo

    demos = demo.load_demos(settings.handlers, include_installed=settings.installed_handlers)
    options = demo.DemoOptions(args.count, args.duplicates, args.accounts, args.seed)
    for line in asyncio.run(demo.send(settings, options, demos)):
        print(line)
    return 0


def _show(line: str, file: TextIO | None = None) -> None:
    """Print one line of output with its control characters escaped (``logs.printable``) and URL
    passwords redacted: what a message, a row or a broker carried can neither add lines nor drive
    the terminal."""
    print(logs.redact_text(logs.printable(line)), file=file)


class Exit(enum.IntEnum):
    """The ``worker`` command's exit statuses (docs/cli.md lists them)."""

    OK = 0
    FAILED = 1
    """A check found a failure (``verify``, ``health``), or the command crashed: an unexpected
    error, logged at CRITICAL with its traceback."""
    USAGE = 2
    """A usage or configuration error, a refused login among them: one sentence that names the
    setting to fix."""
    UNREACHABLE = 3
    """PostgreSQL or RabbitMQ could not be reached (after the start-up retries of a long-running
    command): one sentence naming the service, its URL (redacted) and the setting to fix."""
    BROKEN_PIPE = 128 + signal.SIGPIPE
    """The reader of the output went away (``worker status | head -4``): nothing more is said,
    as a command killed by SIGPIPE, whose status a shell shows as 141."""


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived before the command started serving: it stops at once, with
    ``128 + signal``, the status a shell shows for a process killed by that signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _silence_stdout() -> None:
    """Point stdout at /dev/null: its reader is gone, and Python's flush at exit must not
    complain about it (the ``signal`` module's documented way out of a broken pipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``worker`` command; its exit status is one of ``Exit`` (or ``128 + signal``)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:  # (``worker --help | head -1``)
        _silence_stdout()
        return Exit.BROKEN_PIPE
    args.argv = argv  # (``worker run --processes N`` gives its children the same arguments)
    try:
        settings = _load_settings(args)
        logs.configure(settings)
    except ConfigurationError as exc:
        parser.error(logs.redact_text(logs.printable(str(exc))))
    try:
        result: Any = args.func(settings, args)
    except BrokenPipeError:
        _silence_stdout()
        return Exit.BROKEN_PIPE
    except Interrupted as exc:
        _show(f"worker: {args.command} stopped by {exc} while starting", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        _show(f"worker: {args.command} interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT
    except ConfigurationError as exc:
        log.debug("worker %s failed", args.command, exc_info=exc)
        _show(f"worker: error: {exc}", file=sys.stderr)
        return Exit.USAGE
    except ChannelNotFoundEntity as exc:  # (a passive declare of a queue nobody declared)
        log.debug("worker %s failed", args.command, exc_info=exc)
        _show(
            f"worker: error: RabbitMQ says {exc.args[0] if exc.args else exc}: declare the "
            "topology first (`worker declare`, or `worker migrate`), or check WORKER_QUEUE "
            "and the path of WORKER_AMQP_URL",
            file=sys.stderr,
        )
        return Exit.USAGE
    except Exception as exc:
        if (service := unreachable_service(exc)) is not None:
            log.debug("worker %s failed", args.command, exc_info=exc)
            url = settings.database_url if service is Service.POSTGRESQL else settings.amqp_url
            sentence = cannot_reach(service, url, logs.describe_error(innermost(exc)))
            if settings.log_format == "json":  # (what collects the logs reads one object)
                log.error("worker %s failed: %s", args.command, sentence)
            else:
                _show(f"worker: error: {sentence}", file=sys.stderr)
            return Exit.UNREACHABLE
        # Through the configured handler: one JSON object with --log-format json, secrets
        # redacted, control characters escaped; never Python's raw traceback.
        log.critical("worker %s failed: %s", args.command, logs.describe_error(exc), exc_info=exc)
        return Exit.FAILED
    return int(result)
