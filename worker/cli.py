"""The ``worker`` command: run the consumer, run a relay, apply migrations, send demo traffic.

Every setting is a ``WORKER_*`` environment variable and a flag of the same name; a flag wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from worker.errors import ConfigurationError
from worker.plugins import ENTRY_POINT_GROUP, load_routers
from worker.settings import FIELDS, Settings, boolean

log = logging.getLogger("worker")


def _settings_help() -> str:
    defaults = Settings()
    lines = ["settings (environment variable, flag, default):"]
    for spec in FIELDS:
        default = getattr(defaults, spec.name)
        if isinstance(default, tuple):
            default = ",".join(default) or "(none)"
        lines.append(f"  {spec.env:<28} {spec.flag:<22} {default}")
        lines.append(f"      {spec.help}")
    return "\n".join(lines)


def _settings_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("settings (each flag overrides its WORKER_* variable)")
    for spec in FIELDS:
        if spec.parse is boolean:
            group.add_argument(
                spec.flag,
                dest=spec.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{spec.help} [{spec.env}]",
            )
            continue
        group.add_argument(
            spec.flag,
            dest=spec.name,
            type=spec.parse,
            default=None,
            metavar=spec.name.upper(),
            help=f"{spec.help} [{spec.env}]",
        )
    return parser


def build_parser() -> argparse.ArgumentParser:
    common = _settings_parser()
    parser = argparse.ArgumentParser(
        prog="worker",
        description=(
            "An asyncio RabbitMQ worker: each message's effect is committed exactly once in "
            "PostgreSQL together with the events it emits (transactional outbox); the message "
            "is acked only after that commit."
        ),
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        parents=[common],
        help="consume the work queue with the given handler modules",
        description=(
            "Declare the topology and consume until SIGTERM/SIGINT. Handler modules come from "
            f"--handlers, WORKER_HANDLERS and the {ENTRY_POINT_GROUP!r} entry-point group."
        ),
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.set_defaults(func=_run)

    relay = commands.add_parser(
        "relay",
        parents=[common],
        help="publish committed outbox rows (a relay on its own, no consumer)",
        description=(
            "Publish the outbox with publisher confirms until SIGTERM/SIGINT. Any number of "
            "relays may run at once, beside the ones inside `worker run`."
        ),
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    relay.set_defaults(func=_relay)

    migrate = commands.add_parser(
        "migrate",
        parents=[common],
        help="apply the worker's and the handler modules' migrations",
        description="Upgrade the worker's tables, then each handler module's, to their heads.",
    )
    migrate.add_argument(
        "--downgrade", action="store_true", help="undo every migration instead (drops the tables)"
    )
    migrate.set_defaults(func=_migrate)

    demo = commands.add_parser(
        "demo",
        parents=[common],
        help="publish demo payment requests for the payments example",
        description="Publish payment.requested messages, some of them duplicates.",
    )
    demo.add_argument("--count", type=int, default=100, help="messages to send (default 100)")
    demo.add_argument(
        "--duplicates", type=float, default=0.2, help="share of resent payments (default 0.2)"
    )
    demo.add_argument("--accounts", type=int, default=5, help="accounts to spread over")
    demo.add_argument(
        "--seed", type=int, default=1, help="random seed (payment ids derive from it)"
    )
    demo.set_defaults(func=_demo)
    return parser


def _load_settings(args: argparse.Namespace) -> Settings:
    return Settings.load(**{spec.name: getattr(args, spec.name, None) for spec in FIELDS})


def _run(settings: Settings, args: argparse.Namespace) -> int:
    from worker import runner

    router = load_routers(settings.handlers)
    if not router.handlers():
        raise ConfigurationError(
            "no handlers: name handler modules with --handlers or WORKER_HANDLERS, "
            f"or install a package with a {ENTRY_POINT_GROUP!r} entry point"
        )

    asyncio.run(_until_signalled(lambda stop: runner.run(settings, router, stop)))
    return 0


def _relay(settings: Settings, args: argparse.Namespace) -> int:
    from worker import runner

    asyncio.run(_until_signalled(lambda stop: runner.run_relay(settings, stop)))
    return 0


async def _until_signalled(serve: Callable[[asyncio.Event], Awaitable[object]]) -> None:
    """Run ``serve`` until SIGTERM or SIGINT sets its stop event."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(stop)


def _migrate(settings: Settings, args: argparse.Namespace) -> int:
    from worker import schema

    router = load_routers(settings.handlers)
    if args.downgrade:
        schema.downgrade(settings, router)
    else:
        schema.upgrade(settings, router)
        log.info("migrations applied")
    return 0


def _demo(settings: Settings, args: argparse.Namespace) -> int:
    from examples.payments.demo import plan_payments, publish_demo

    plan = plan_payments(args.count, args.duplicates, args.accounts, args.seed)
    asyncio.run(publish_demo(settings, plan))
    print(
        f"published {len(plan.sends)} payment requests: {len(plan.payments)} unique payments, "
        f"{len(plan.sends) - len(plan.payments)} duplicates"
    )
    for account, cents in sorted(plan.expected_balances.items()):
        print(f"  expected balance of {account}: {cents} cents (from this run)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = _load_settings(args)
    except ConfigurationError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
    logging.getLogger("aiormq").setLevel(logging.WARNING)
    try:
        result: Any = args.func(settings, args)
    except ConfigurationError as exc:
        print(f"worker: error: {exc}", file=sys.stderr)
        return 2
    return int(result)
