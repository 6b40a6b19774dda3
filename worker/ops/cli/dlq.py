"""``worker dlq list``, ``show``, ``replay`` and ``purge``: their flags and what they print (the
work itself is ``worker.ops.dlq``'s)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from aio_pika.abc import AbstractRobustConnection

from worker import logs
from worker.errors import ConfigurationError
from worker.ops.cli.broker import with_broker
from worker.ops.cli.command import Command, Family
from worker.ops.cli.output import show, summary, verbose
from worker.settings import Group, Settings, positive_int

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from worker.ops.dlq import Outcome, Parked, Selection, Shown

_T = TypeVar("_T")

DLQ_LIST_LIMIT = 100
"""Messages ``worker dlq list`` shows unless told otherwise."""

DLQ_SHOW_BODY_BYTES = 4096
"""Bytes of a body ``worker dlq show`` prints unless ``--full``."""


def _filters(parser: argparse.ArgumentParser) -> None:
    """The flags that select parked messages, shared by every ``dlq`` action."""
    parser.add_argument("--key", help="only the messages with this idempotency key")
    parser.add_argument(
        "--reason",
        help="only the messages parked for this reason (`unverified`: those without the "
        "worker's record of parking them)",
    )
    parser.add_argument(
        "--handler",
        help="only the messages of this handler (its name: its routing key unless it sets "
        "name=; `-` for the messages without one)",
    )


def _selection(args: argparse.Namespace) -> Selection:
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

    return await with_broker(settings, with_engine)


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


def _list(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import dlq

    limit = None if args.all else args.limit
    selection = _selection(args)

    async def list_parked(connection: AbstractRobustConnection, engine: AsyncEngine) -> int:
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

    shown = asyncio.run(_with_dlq(settings, list_parked))
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


def _list_options(parser: argparse.ArgumentParser) -> None:
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument(
        "--limit", type=positive_int, default=DLQ_LIST_LIMIT, help=f"default {DLQ_LIST_LIMIT}"
    )
    shown.add_argument("--all", action="store_true", help="show every parked message")
    _filters(parser)
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per message, no summary line"
    )


LIST = Command(
    "dlq list",
    _list,
    "show what is parked and why (the messages stay parked)",
    "Show the parked messages, oldest first, one line each as it is read; the queue is "
    "left as it was.",
    options=_list_options,
)


def _show(settings: Settings, args: argparse.Namespace) -> int:
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
    """Print one parked message in full, every line escaped (``show``): a body or a header can
    neither add lines nor drive the terminal."""
    from worker.ops.dlq import header_text

    parked = shown.parked
    show(f"id: {parked.id}")
    if parked.verified:
        show("provenance: parked by the worker (its record names this copy)")
    else:
        show(f"provenance: unverified ({parked.unverified_because}): its headers are claims")
    show(_describe(parked))
    show("properties:")
    for name, value in shown.properties.items():
        if value is not None:
            show(f"  {name}: {header_text(value)}")
    show("headers:")
    for name, value in shown.headers.items():
        show(f"  {name}: {header_text(value)}")
    body = shown.body if full else shown.body[:DLQ_SHOW_BODY_BYTES]
    cut = len(shown.body) - len(body)
    show(
        f"body ({len(shown.body)} bytes"
        + (f"; the first {len(body)} shown, --full shows all" if cut else "")
        + "):"
    )
    for line in body.decode("utf-8", "replace").split("\n"):
        show(line)


def _show_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="the message's id, as `worker dlq list` shows it")
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"the whole body (default: its first {DLQ_SHOW_BODY_BYTES} bytes)",
    )


SHOW = Command(
    "dlq show",
    _show,
    "show one parked message in full: provenance, properties, headers, body",
    "Show the parked message with this id (`dlq list` shows each message's id: the "
    "worker's parking id, or sha256:... for a copy without the worker's record), its "
    "headers and its body, escaped for the terminal; the queue is left as it was.",
    options=_show_options,
)


def _replay(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import dlq

    selection = _selection(args)
    done, refused = _bulk(
        settings,
        lambda connection, engine: dlq.replaying(
            connection,
            engine,
            settings,
            selection=selection,
            limit=args.limit,
            force=args.force,
            dry_run=args.dry_run,
        ),
        "would replay" if args.dry_run else "replayed",
        verbose=args.verbose,
    )
    said = f"{done} message(s) sent back to {settings.queue}"
    if args.dry_run:
        said = f"dry run: {done} message(s) would be sent back to {settings.queue}"
    if refused:
        said += f"; {refused} refused and left parked (--force replays them)"
    print(said + ("; nothing changed" if args.dry_run else ""))
    return 0


def _replay_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=positive_int, help="replay at most this many")
    _filters(parser)
    parser.add_argument(
        "--force",
        action="store_true",
        help="replay messages parked before inbox_retention too, and unverified ones as fresh "
        "deliveries",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="show what would be replayed; change nothing"
    )
    verbose(parser)


REPLAY = Command(
    "dlq replay",
    _replay,
    "clear the failed state and send parked messages back to the work queue",
    "For each parked message that the filters select (oldest first): forget that its key "
    "failed, send it back to the work queue, remove it from the DLQ. Each replayed message "
    "runs once. Refused and left parked unless --force: a message parked longer ago than "
    "inbox_retention (its key may have expired from the inbox, so it could run twice), and "
    "an unverified one (no record that the worker parked it: its headers could be anyone's; "
    "forced, it goes back as a fresh delivery that clears no inbox row). Prints a summary "
    "by reason and handler (--verbose: a line per message too).",
    reads=(Group.RETRIES,),
    options=_replay_options,
)


def _purge(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import dlq

    selection = _selection(args)
    if not selection.filters and not args.all:
        raise ConfigurationError("dlq purge needs --key, --reason, --handler or --all")
    done, refused = _bulk(
        settings,
        lambda connection, engine: dlq.purging(
            connection,
            engine,
            settings,
            selection=selection,
            limit=args.limit,
            dry_run=args.dry_run,
        ),
        "would purge" if args.dry_run else "purged",
        verbose=args.verbose,
    )
    if args.dry_run:
        said = f"dry run: {done} message(s) would be purged from {settings.dead_letter_queue}"
    else:
        said = f"{done} message(s) purged from {settings.dead_letter_queue}"
    if refused:
        said += f"; {refused} unverified left parked (--reason unverified purges them)"
    print(said)
    return 0


def _purge_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=positive_int, help="delete at most this many")
    _filters(parser)
    parser.add_argument("--all", action="store_true", help="delete every parked message")
    parser.add_argument(
        "--dry-run", action="store_true", help="show what would be deleted; change nothing"
    )
    verbose(parser)


PURGE = Command(
    "dlq purge",
    _purge,
    "delete the parked messages the filters select",
    "Delete each parked message that the filters select (all of them with --all); the "
    "others keep their place. Asks nothing: give at least one filter or --all. An "
    "unverified message (no record that the worker parked it) is deleted only with "
    "--reason unverified or --all. Messages parked after the purge began are left. Prints "
    "a summary by reason and handler (--verbose: a line per message too).",
    options=_purge_options,
)


def _bulk(
    settings: Settings,
    start: Callable[[AbstractRobustConnection, AsyncEngine], AsyncGenerator[Outcome, None]],
    done: str,
    *,
    verbose: bool,
) -> tuple[int, int]:
    """Carry out the bulk ``dlq`` action ``start`` begins, reporting it (``_report``); returns
    (done, refused)."""

    async def carry_out(
        connection: AbstractRobustConnection, engine: AsyncEngine
    ) -> tuple[int, int]:
        return await _report(start(connection, engine), done, verbose=verbose)

    return asyncio.run(_with_dlq(settings, carry_out))


async def _report(
    outcomes: AsyncGenerator[Outcome, None], done: str, *, verbose: bool
) -> tuple[int, int]:
    """Carry out a bulk ``dlq`` action and print what it did, summed up by reason and handler
    (``dlq.Tally``; with ``verbose``, a line per message as it happens too); returns (done,
    refused)."""
    from worker.ops.dlq import Tally

    def line(outcome: Outcome) -> None:
        if outcome.done:
            print(f"{done} {_describe(outcome.parked)}", flush=True)
        else:
            print(f"refused {_describe(outcome.parked)}: {outcome.refused}", flush=True)

    tally = await Tally().carry_out(outcomes, line if verbose else None)
    done_by = Counter(
        {f"{reason} handler={handler}": count for (reason, handler), count in tally.done.items()}
    )
    summary(f"{done} by reason", done_by)
    summary("refused", tally.refused)
    return tally.done_count, tally.refused_count


DLQ = Family(
    "dlq",
    "inspect, replay or purge the dead-letter queue",
    "Messages parked in <queue>.dlq, and why; replay sends them back to run, "
    "purge deletes them. Each reads the queue a bounded chunk of messages at a time and acts "
    "on one at a time; the messages it leaves keep their place and order.",
    (LIST, SHOW, REPLAY, PURGE),
)
