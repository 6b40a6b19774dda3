"""The long-running commands and the janitor's: ``run`` (the consumer, with relays and the
janitor inside), ``relay``, ``serve`` (the HTTP ingress), ``gc`` (one janitor sweep) and
``workflows`` (the workflows in progress)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from worker.core.router import Router
from worker.errors import ConfigurationError
from worker.ops import supervisor
from worker.ops.cli.command import Command, import_extra
from worker.ops.cli.exits import until_signalled
from worker.ops.cli.output import show
from worker.ops.plugins import ENTRY_POINT_GROUP, load_routers
from worker.settings import Group, Settings, format_duration, positive_int

if TYPE_CHECKING:
    from worker.sql import inspection

HTTP_EXTRA = frozenset({"fastapi", "starlette", "uvicorn", "h11", "anyio", "click"})
"""Top-level modules of the ``http`` extra's packages: ``worker serve`` without one of them says
which extra to install."""


def _run(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import runner

    if settings.processes > 1:
        return supervisor.run_processes(settings, args.argv)
    router = _handler_modules(settings)

    async def serve(stop: asyncio.Event, started: asyncio.Event) -> None:
        supervisor.stop_when_orphaned(stop)
        await runner.run(settings, router, stop, started)

    asyncio.run(until_signalled(serve))
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


RUN = Command(
    "run",
    _run,
    "consume the work queue with the given handler modules",
    "Declare the topology and consume until SIGTERM/SIGINT. Handler modules come from "
    f"the handlers setting and the {ENTRY_POINT_GROUP!r} entry-point group. With the "
    "processes setting above 1, this process supervises that many such worker processes: it "
    "forwards SIGTERM/SIGINT to them (another signal while they stop kills them), and "
    f"{supervisor.RestartPolicy().describe()}.",
    reads=(
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
)


def _relay(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import runner

    asyncio.run(until_signalled(lambda stop, started: runner.run_relay(settings, stop, started)))
    return 0


RELAY = Command(
    "relay",
    _relay,
    "publish committed outbox rows (a relay on its own, no consumer)",
    "Publish the outbox with publisher confirms until SIGTERM/SIGINT. Any number of "
    "relays may run at once, beside the ones inside `worker run`.",
    reads=(Group.PROCESS, Group.ENDPOINT, Group.RELAY, Group.NOTIFY),
)


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    serve = import_extra("worker.ingress.serve", command="serve", extra="http", packages=HTTP_EXTRA)
    router = _handler_modules(settings)
    asyncio.run(
        until_signalled(
            lambda stop, started: serve.serve(
                settings, router, stop, started=lambda _port: started.set()
            )
        )
    )
    return 0


SERVE = Command(
    "serve",
    _serve,
    "serve the HTTP ingress: POST a message, GET its handler's result",
    "Serve POST /messages/<routing key> (a JSON body and an Idempotency-Key header: the "
    "request and its event are recorded in one transaction, 202 Accepted) and GET "
    "/messages/<routing key>/<key> (pending, completed with the handler's result, or "
    "failed) for every routing key of the handler modules, OpenAPI at /docs and /healthz, "
    "until SIGTERM/SIGINT; requests in flight then finish. Needs the http extra: "
    "pip install 'rabbit-outbox-worker[http]'.",
    reads=(Group.INGRESS, Group.LIMITS),
    aliases={"ingress_host": "--host", "ingress_port": "--port"},
)


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


GC = Command(
    "gc",
    _gc,
    "delete inbox keys older than the retention window, once",
    "One janitor sweep: delete completed and failed inbox keys older than "
    "inbox_retention in batches, then the ingress's requests accepted longer ago, unless "
    "another janitor is sweeping right now.",
    reads=(Group.RETRIES, Group.SWEEP),
)


def _workflows(settings: Settings, args: argparse.Namespace) -> int:
    if args.action == "resume":
        return _resume(settings, args)
    if args.handler is not None:
        raise ConfigurationError("worker workflows list takes no HANDLER or KEY")
    return _list_workflows(settings, args)


def _resume(settings: Settings, args: argparse.Namespace) -> int:
    from worker.database import one_connection
    from worker.ops import admin, workflows

    if args.handler is None or args.key is None:
        raise ConfigurationError("worker workflows resume needs a HANDLER and a KEY")

    async def resume() -> workflows.Resumed:
        async with one_connection(settings, admin.APPLICATION_NAME) as engine:
            return await workflows.resume(engine, args.handler, args.key)

    try:
        resumed = asyncio.run(resume())
    except workflows.NotResumable as exc:
        if args.json:
            print(admin.to_json({"handler": args.handler, "key": args.key, "error": str(exc)}))
        show(f"not resumed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(admin.to_json(resumed))
    elif resumed.message_id is None:
        show(
            f"released workflow {resumed.key} of {resumed.handler}; it never waited, so no "
            "message of it is stored: publish its starting message again, with its key, to "
            "resume it",
            file=sys.stderr,
        )
    else:
        show(
            f"resumed workflow {resumed.key} of {resumed.handler}: its resume message "
            f"{resumed.message_id} (wait {resumed.wait}) is in the outbox"
        )
    return 1 if resumed.message_id is None else 0


def _list_workflows(settings: Settings, args: argparse.Namespace) -> int:
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
            show(
                f"handler={state.handler} key={state.key} "
                f"recovery_point={state.recovery_point or '-'} owner={state.owner or '-'} "
                f"lease_until={state.lease_until.isoformat() if state.lease_until else '-'} "
                f"attempts={state.attempts} updated_at={state.updated_at.isoformat()}"
                f"{_waiting(state)}"
            )
    if not args.json:
        waiting = sum(1 for state in states if state.wait is not None)
        print(f"{len(states)} workflow(s) in progress, {waiting} of them waiting")
    return 0


def _waiting(state: inspection.WorkflowState) -> str:
    """What a waiting workflow waits for, and until when, as ``worker workflows`` shows it."""
    if state.wait is None or state.wait_due_at is None:
        return ""
    until = state.wait_due_at.isoformat()
    if state.wait_routing_key is None:
        return f" waiting={state.wait} sleep until={until}"
    return (
        f" waiting={state.wait} signal={state.wait_routing_key} "
        f"correlation={state.wait_correlation} until={until}"
    )


def _workflows_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        choices=("list", "resume"),
        default="list",
        help="list (the default) or resume HANDLER KEY",
    )
    parser.add_argument("handler", nargs="?", metavar="HANDLER", help="resume: its handler")
    parser.add_argument("key", nargs="?", metavar="KEY", help="resume: its idempotency key")
    parser.add_argument("--limit", type=positive_int, default=100, help="list: default 100")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")


WORKFLOWS = Command(
    "workflows",
    _workflows,
    "list workflows in progress: their recovery point, owner and lease, and what they wait for",
    "Workflows whose key is in progress, least recently advanced first: the last committed "
    "step, the delivery that owns it and until when (an expired lease is taken over by the "
    "next delivery); a waiting workflow owns nothing and shows its wait: the signal's routing "
    "key and correlation, or a sleep, and its deadline by the database's clock.\n\n"
    "`worker workflows resume HANDLER KEY` resumes one whose owner died with no message left "
    "to resume it (`worker verify` names them, as no-orphaned-workflows): it releases the "
    "dead owner and puts a copy of the workflow's resume message in the outbox, which "
    "replays its committed steps and carries it on; refused (exit 1) for a key not in "
    "progress, one a live run owns, or one waiting for a deadline still to come.",
    options=_workflows_options,
)

COMMANDS = (RUN, RELAY, SERVE, GC, WORKFLOWS)
