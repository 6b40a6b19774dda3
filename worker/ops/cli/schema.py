"""What the deployment is made of: ``worker migrate`` (the tables), ``declare`` and
``convert-queues`` (the broker topology), ``asyncapi`` (the handler modules' document)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from aio_pika.abc import AbstractRobustConnection

from worker.errors import ConfigurationError
from worker.ops.cli.broker import with_broker
from worker.ops.cli.command import Command
from worker.ops.plugins import load_routers
from worker.settings import Group, Settings

log = logging.getLogger("worker")


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


def _migrate_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--downgrade", action="store_true", help="undo every migration instead (drops the tables)"
    )
    parser.add_argument(
        "--no-declare",
        dest="declare",
        action="store_false",
        help="leave the broker alone (migrate the database only)",
    )


MIGRATE = Command(
    "migrate",
    _migrate,
    "apply the worker's and the handler modules' migrations",
    "Upgrade the worker's tables, then each handler module's, to their heads; then "
    "declare the broker topology (as `worker declare`), so that messages published before "
    "the first `worker run` wait in the work queue instead of being dropped.",
    reads=(Group.RETRIES,),
    options=_migrate_options,
)


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


def _asyncapi_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--title", help="the document's title (default: the handler modules)")
    parser.add_argument("--output", "-o", help="write it to this file instead of stdout")


ASYNCAPI = Command(
    "asyncapi",
    _asyncapi,
    "print the AsyncAPI document of the handler modules",
    "An AsyncAPI 3.0 document (JSON) generated from the handler modules: a channel per "
    "routing key on the exchange, each handler's body schema as its payload, and the events "
    "the handlers declare with publishes=. Nothing is connected to.",
    options=_asyncapi_options,
)


def _declare(settings: Settings, args: argparse.Namespace) -> int:
    from worker.transport.topology import declare_topology

    routing_keys = load_routers(
        settings.handlers, include_installed=settings.installed_handlers
    ).routing_keys()

    async def declare(connection: AbstractRobustConnection) -> None:
        async with connection.channel() as channel:
            await declare_topology(channel, settings, routing_keys)

    asyncio.run(with_broker(settings, declare, name="worker-declare"))
    log.info(
        "declared exchange %r, queue %r bound to %s, %r and %d retry queue(s)",
        settings.exchange,
        settings.queue,
        ", ".join(map(repr, routing_keys)) or "no routing key",
        settings.dead_letter_queue,
        len(settings.retry_delays),
    )
    return 0


DECLARE = Command(
    "declare",
    _declare,
    "declare the exchange, queues and bindings the handler modules need",
    "Declare (or confirm) the durable exchange, the work queue bound with every routing key "
    "of the handler modules, the dead-letter exchange and queue, and the delayed-retry "
    "queues, as `worker run` does at start; idempotent. Producers may then publish before "
    "any worker runs.",
    reads=(Group.RETRIES,),
)


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

    return asyncio.run(with_broker(settings, run, name="worker-convert-queues"))


CONVERT_QUEUES = Command(
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
    reads=(Group.RETRIES,),
)

COMMANDS = (MIGRATE, ASYNCAPI, DECLARE, CONVERT_QUEUES)
"""In the order ``worker --help`` lists them."""
