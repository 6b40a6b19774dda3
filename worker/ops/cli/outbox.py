"""``worker outbox list``, ``retry`` and ``cancel``: their flags and what they print (the
reading, the moving and the cancelling are ``worker.ops.admin``'s)."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

from worker.ops.cli.command import Command, Family
from worker.ops.cli.exits import Exit
from worker.ops.cli.output import show, summary, verbose
from worker.settings import Group, Settings, positive_int
from worker.sql.inspection import OUTBOX_STATES, RETRY_STATES


def _chosen(states: Sequence[str], asked: Sequence[str] | None) -> list[str]:
    """The ``states`` asked for with ``--state`` (each once, in ``states``' order), or all."""
    return [state for state in states if asked is None or state in asked]


def _list(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import admin

    states = _chosen(OUTBOX_STATES, args.states)
    entries = asyncio.run(
        admin.outbox_list(settings, states, routing_key=args.routing_key, limit=args.limit)
    )
    for entry in entries:
        if args.json:
            print(admin.to_json(entry))
        else:
            show(_line(entry))
    if args.json:
        return 0
    shown = Counter(entry.state for entry in entries)
    counts = ", ".join(f"{shown[state]} {state}" for state in states)
    print(f"{counts} outbox row(s) shown")
    full = [state for state in states if shown[state] == args.limit]
    if full:
        print(f"(--limit {args.limit} reached for {', '.join(full)}: there may be more)")
    waiting = {entry.routing_key for entry in entries if entry.state in RETRY_STATES}
    if any(entry.state == "scheduled" for entry in entries):
        show("`worker outbox cancel MESSAGE_ID...` takes scheduled and pending events back")
    if waiting:
        key = shlex.quote(waiting.pop()) if len(waiting) == 1 else "KEY"
        show(
            f"`worker outbox retry --routing-key {key}` (or --id ID, --all) publishes "
            "backing-off and parked rows now"
        )
    return 0


def _line(entry: Any) -> str:
    """One row of ``worker outbox list``: its state, then ``name=value`` pairs."""
    fields = [
        f"{entry.state:<11} id={entry.id} message_id={entry.message_id}",
        f"exchange={entry.exchange or '(default)'} routing_key={entry.routing_key}",
        f"ordering_key={entry.ordering_key or '-'} attempts={entry.attempts}",
        f"created_at={entry.created_at.isoformat()}",
    ]
    if entry.parked_at is not None:
        fields.append(f"parked_at={entry.parked_at.isoformat()}")
    elif entry.state == "scheduled":
        fields.append(f"due_at={entry.available_at.isoformat()} ({_due(entry.due_in_seconds)})")
    elif entry.attempts:
        fields.append(
            f"next_attempt={entry.available_at.isoformat()} (in {entry.due_in_seconds:.0f}s)"
        )
    if entry.last_error is not None:
        fields.append(f"last_error={entry.last_error!r}")
    return " ".join(fields)


def _due(seconds: float) -> str:
    """How far ahead a scheduled event's due time is, or how long it is overdue."""
    return f"in {seconds:.0f}s" if seconds >= 0 else f"overdue by {-seconds:.0f}s"


def _list_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state",
        dest="states",
        action="append",
        choices=OUTBOX_STATES,
        help="only rows in this state (repeatable; default: every state)",
    )
    parser.add_argument("--routing-key", help="only rows of this routing key (exact)")
    parser.add_argument(
        "--limit", type=positive_int, default=100, help="at most this many rows of each state"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")


LIST = Command(
    "outbox list",
    _list,
    "show unpublished events in every state, or in --state (nothing changes)",
    "Show unpublished events without their bodies: scheduled rows earliest due first (their "
    "due time by the database's clock, how far ahead or how long overdue), pending and "
    "backing-off rows in the order the relay takes them (their next attempt, its time by the "
    "database's clock, their attempts and last error), parked rows oldest first. At most "
    "--limit rows of each state, read from an index, however large the outbox.",
    options=_list_options,
)


def _retry(settings: Settings, args: argparse.Namespace) -> int:
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
            show(f"hurried id={hurried.id} message_id={hurried.message_id}")
        for moved in retried.moved:
            show(f"retried id={moved.parked_id} as id={moved.id} message_id={moved.message_id}")
    summary("retried by routing key", Counter(retried.routing_keys))
    print(
        f"{len(retried.hurried)} backing-off outbox row(s) made due now, "
        f"{len(retried.moved)} parked outbox row(s) moved back into the outbox"
    )
    if retried.due:
        show(f"already due (pending): {', '.join(map(str, retried.due))}", file=sys.stderr)
    if retried.unknown:
        show(
            f"worker: error: no {' or '.join(states)} outbox row has id "
            f"{', '.join(map(str, retried.unknown))} (see `worker outbox list`)",
            file=sys.stderr,
        )
        return 1
    if args.routing_key is not None and not retried.routing_keys:
        show(
            f"worker: error: no {' or '.join(states)} outbox row has routing key "
            f"{args.routing_key!r} (see `worker outbox list`)",
            file=sys.stderr,
        )
        return 1
    return 0


def _retry_options(parser: argparse.ArgumentParser) -> None:
    verbose(parser)
    which = parser.add_mutually_exclusive_group(required=True)
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
    parser.add_argument(
        "--state",
        dest="states",
        action="append",
        choices=RETRY_STATES,
        help="only rows in this state (repeatable; default: both)",
    )


RETRY = Command(
    "outbox retry",
    _retry,
    "publish backing-off and parked outbox rows now",
    "In one transaction: backing-off rows become due now by the database's clock (they keep "
    "their attempts), and parked rows move back into the outbox with their message_id, 0 "
    "attempts and their last error (each gets a new outbox id: a row with an ordering key "
    "goes out after the rows of its key emitted before the retry); relays are woken at "
    "commit. Which rows: --id, --routing-key or --all, of --state (default both). Prints "
    "how many by routing key (a line per row too with --id or --verbose). Exits 1 when an "
    "--id or the --routing-key matches no backing-off or parked row.",
    reads=(Group.NOTIFY,),
    options=_retry_options,
)


def _cancel(settings: Settings, args: argparse.Namespace) -> int:
    from worker.ops import admin

    done = asyncio.run(admin.cancel_outbox(settings, args.message_ids, dry_run=args.dry_run))
    verb = "would cancel" if args.dry_run else "cancelled"
    outcomes = [
        *((message_id, verb) for message_id in done.cancelled),
        *((message_id, "parked") for message_id in done.parked),
        *((message_id, "unknown") for message_id in done.unknown),
    ]
    for message_id, outcome in outcomes:
        if args.json:
            print(admin.to_json({"message_id": message_id, "outcome": outcome}))
        else:
            show(f"{outcome:<12} message_id={message_id}")
    if not args.json:
        said = f"{len(done.cancelled)} outbox event(s)"
        if args.dry_run:
            print(f"dry run: {said} would be cancelled; nothing changed")
        else:
            print(f"{said} cancelled")
    if done.parked:
        show(
            f"worker: error: parked, not cancelled: {', '.join(map(str, done.parked))} "
            "(see `worker outbox list --state parked`)",
            file=sys.stderr,
        )
    if done.unknown:
        show(
            f"worker: error: no unpublished event has message_id "
            f"{', '.join(map(str, done.unknown))} (published already, or never sent)",
            file=sys.stderr,
        )
    return Exit.FAILED if done.parked or done.unknown else Exit.OK


def _message_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a message id (a UUID)") from None


def _cancel_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "message_ids",
        type=_message_id,
        nargs="+",
        metavar="MESSAGE_ID",
        help="the events' message ids (as `worker outbox list` shows them)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="show what would be cancelled; change nothing"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per message id")


CANCEL = Command(
    "outbox cancel",
    _cancel,
    "take unpublished events back (scheduled or pending): they are never published",
    "In one transaction, for each MESSAGE_ID: an event scheduled for later, or waiting in "
    "the outbox (pending or backing off), is deleted, so it is never published (a relay "
    "publishing it at that instant finishes first, and then it is not there to cancel). "
    "Prints a line per message id: cancelled, parked (left in outbox_parked) or unknown "
    "(published already, or never sent: the outbox keeps no record of what it published), "
    "and the total. --dry-run rolls the transaction back and says what it would have done. "
    "Exits 1 when a message id was not cancelled.",
    options=_cancel_options,
)

OUTBOX = Family(
    "outbox",
    "list unpublished events (scheduled, pending, backing off, parked), publish or cancel them",
    "Events committed to the outbox and not yet confirmed by the broker: scheduled (waiting "
    "in outbox_scheduled for their due time by the database's clock), pending (due, a relay "
    "takes them next), backing-off (a publish failed; retried at their next attempt) and "
    "parked (in outbox_parked after the last attempt failed).",
    (LIST, RETRY, CANCEL),
)
