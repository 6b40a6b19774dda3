"""``worker demo``: run the handler modules' demo hooks (the work is ``worker.ops.demo``'s)."""

from __future__ import annotations

import argparse
import asyncio

from worker.ops.cli.command import Command
from worker.settings import Group, Settings


def _demo(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import demo

    demos = demo.load_demos(settings.handlers, include_installed=settings.installed_handlers)
    options = demo.DemoOptions(args.count, args.duplicates, args.accounts, args.seed)
    for line in asyncio.run(demo.send(settings, options, demos)):
        print(line)
    return 0


def _demo_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=int, default=100, help="messages to send (default 100)")
    parser.add_argument(
        "--duplicates", type=float, default=0.2, help="share of resent payments (default 0.2)"
    )
    parser.add_argument("--accounts", type=int, default=5, help="accounts to spread over")
    parser.add_argument(
        "--seed", type=int, default=1, help="random seed (payment ids derive from it)"
    )


DEMO = Command(
    "demo",
    _demo,
    "run the handler modules' demo hooks (the payments example's: payment requests)",
    "Run the `demo` hook of each handler module (default: examples.payments, whose hook "
    "publishes payment.requested messages, some of them duplicates, and prints the balances "
    "to expect).",
    reads=(Group.RETRIES,),
    options=_demo_options,
)
